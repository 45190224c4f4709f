# Atelier — every target does its own setup: a fresh clone needs nothing but Python 3.11.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo lint test test-isolated test-portable test-fast serve stop clean venv lock

venv: $(STAMP)

# torch first, from the local 2.14.1 build (a CUDA wheel that runs on the CPU); then the package itself in editable
# mode with the dev extra (nothing in it needs torchvision, which would pin torch to its own release), at the
# versions in constraints.txt: the ones the demo's scores and the tests' timings were measured with (docs/demo.md),
# not whatever the index holds today.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1
	$(PY) -m pip uninstall -q -y atelier 2>/dev/null || true  # the distribution's name before atelier-studio
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# constraints.txt := the venv's versions (pip freeze), less Atelier itself, pip, torch (set above), torchvision and
# what the torch wheel pins for itself (triton, the nvidia-* / cuda-* runtime). Run it only on purpose: after
# upgrading the venv (docs/demo.md, "The versions"), then measure `make demo` again and commit both together.
LOCK_SKIP := ^(pip|torch|torchvision|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==
lock: $(STAMP)
	{ echo "# pip constraints: the versions the demo's scores were measured with (docs/demo.md). Written by \`make lock\`."; \
	  $(PY) -m pip freeze --all --exclude-editable | grep -Ev '$(LOCK_SKIP)' | grep -v '^#'; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

# The CLI's one-line errors depend on what earlier imports printed, so a test file that passes only after another
# hides a bug a user sees (test_bad_input.py alone once failed two rows). ISOLATED_TESTS leave the main pass and run
# each in a fresh pytest process of its own: the same tests, no extra time but a process start.
ISOLATED_TESTS := tests/test_bad_input.py
# ruff (pyproject.toml's [tool.ruff]: line length 120, import order, pyflakes): the tree stays clean
lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q -m "not gpu" $(addprefix --ignore=,$(ISOLATED_TESTS))
	$(MAKE) --no-print-directory test-isolated

test-isolated: $(STAMP)
	@for f in $(ISOLATED_TESTS); do echo "test-isolated: $$f alone"; $(PY) -m pytest -q -m "not gpu" $$f || exit 1; done

# The numerics-sensitive tests (kernels, models against their references and peers, packing, the distributed
# runs) a second time on torch's DEFAULT CPU kernels with one thread, another summation order than `make test`'s:
# a tolerance tuned to one CPU's vector path fails here, not on a user's machine (docs/testing.md). ATen reads
# ATEN_CPU_CAPABILITY once, at import, so it is set here, before Python starts; --portable-numerics checks it.
PORTABLE_TESTS := tests/kernels tests/designer tests/imagegen/test_model.py tests/imagegen/test_autoencoder.py \
	tests/imagegen/test_lora.py tests/imagegen/test_distributed.py tests/pipeline/test_distributed.py tests/pipeline/test_policies.py \
	tests/pipeline/test_trainer.py tests/pipeline/test_sharded_optimizers.py tests/data/test_packing.py
# Left out of this pass: the torch.compile tests (Inductor's generated code picks its own vector ISA, whatever
# ATEN_CPU_CAPABILITY says, and they compare compiled with eager on one path) and the signal tests (kill, SIGTERM:
# process behaviour, no arithmetic): a third of the pass's time, nothing it could catch.
PORTABLE_SKIP := not compile and not sigkill and not sigterm and not kill_mid
test-portable: $(STAMP)
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
		$(PY) -m pytest -q -m "not gpu" -k "$(PORTABLE_SKIP)" --portable-numerics $(PORTABLE_TESTS)

# Prefect: the local server (SQLite under the checkout's .prefect/, Prefect's own PREFECT_HOME setting; prefect.toml
# gives the URL) and the serve process; no telemetry.
PREFECT_ENV := DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_HOME=$(CURDIR)/.prefect

# The whole product on the shapes world, through Prefect; leaves the server running (`make stop`). See docs/demo.md.
# `make demo IMAGEGEN=flux` renders with a FLUX.1-shaped model instead of the SD3-shaped MMDiT.
IMAGEGEN ?= mmdit
demo: $(STAMP)
	$(PREFECT_ENV) $(PY) -m atelier_studio.flows.demo --imagegen $(IMAGEGEN)

serve: $(STAMP)
	$(PREFECT_ENV) $(PY) -m atelier_studio.flows.serve start

stop:
	$(PREFECT_ENV) $(PY) -m atelier_studio.flows.serve stop

clean:
	rm -rf $(VENV) .pytest_cache runs models
