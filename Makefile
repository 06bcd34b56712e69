# Two commands: `make demo` (synthetic head CT -> ViT -> predictions and rollout maps) and `make test`.
# `make check`: lint and the tests that take well under a second each: run it before every commit.
# `make floors`: a fast subset of the tests on every dependency at the lowest version pyproject.toml allows.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
OUT ?= outputs/demo
ARGS ?=  # extra vit-ct arguments for the demo's fit and predict (tests/test_readme.py passes tiny sizes)

.PHONY: demo review check test floors lint format clean docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev,notebook]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/vit-ct fit --config configs/demo.yaml $(ARGS)
	$(BIN)/vit-ct predict --config configs/demo.yaml --ckpt_path "$$($(BIN)/python -m vit_ct.run.summary best_checkpoint)" \
		--data.init_args.predict_split test --output_dir $(OUT) --overwrite true $(ARGS)
	@$(BIN)/python -m vit_ct.run.summary report $(OUT)

review: $(VENV)/.installed
	$(BIN)/python -m vit_ct.review --output_dir outputs/review

# Before every commit: the lint and the tests that take well under a second each (no `slow` or `medium` marker).
check: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -m "not slow and not medium" --durations=10

# Every tier, the files spread over the cores (pytest-xdist; one file's tests stay in one worker, which shares its
# module fixtures), the slowest 20 tests listed.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadfile --durations=20

# A fresh venv every time, every floor of pyproject.toml pinned (.ci/floors.py writes the constraints; whatever the
# floors leave open resolves to its newest release), the package installed as a user gets it (not editable).
FLOORS_VENV := .venv-floors
FLOORS_PYTHON ?= $(PYTHON)  # e.g. python3.10, the lowest Python pyproject.toml allows
FLOORS_DEV := pytest scikit-learn pydicom-data  # the dev extras the subset imports (sklearn, pydicom's test files)
# Import and layering, every private name vit_ct.compat lists, the model against timm, attention recording and
# rollout against hand-computed references, checkpoints (save, load, input contract, resume), the CLI (every config,
# fit -> predict through the real command, bad input), W&B media, DICOM / NIfTI reading against pydicom, the DICOM
# objects of predict --dicom_out read back (highdicom), the DICOMweb client against Orthanc.
# test_states_merge_like_ddp is left out: only the test uses Metric.merge_state (torchmetrics 1.6); DDP reaches the
# same states through torchmetrics' own sync, present in 1.4.
FLOORS_TESTS := tests/test_layout.py tests/run/test_compat.py tests/task/test_model.py tests/explain/test_attention.py \
	tests/explain/test_rollout.py tests/task/test_sink.py tests/run/test_checkpoint.py tests/model/test_contract.py \
	tests/run/test_last_checkpoint.py tests/run/test_cli.py tests/run/test_failures.py tests/run/test_callbacks.py tests/data/test_reader.py \
	tests/metrics/test_localisation.py tests/explain/test_segmentation.py tests/data/test_datamodule.py tests/data/test_windows.py \
	tests/predict/test_dicom_objects.py tests/pacs/test_pacs.py \
	--deselect tests/metrics/test_localisation.py::test_states_merge_like_ddp
FLOORS_SLOW_TESTS := tests/run/test_cli.py::test_fit_then_predict_through_the_real_command \
	tests/run/test_checkpoint.py::test_resume_after_sigkill_matches_an_uninterrupted_run \
	tests/run/test_failures.py::test_an_error_prints_its_message_not_a_traceback \
	tests/run/test_failures.py::test_a_run_logs_no_wandb_deprecation_noise_nor_lightnings_advertisement

floors:
	rm -rf $(FLOORS_VENV) build  # build/: setuptools' copy of the package, which could keep removed modules
	$(FLOORS_PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PYTHON) .ci/floors.py dev > $(FLOORS_VENV)/constraints.txt
	$(FLOORS_VENV)/bin/python -m pip install --quiet -c $(FLOORS_VENV)/constraints.txt . $(FLOORS_DEV)
	$(FLOORS_VENV)/bin/python -m pip check
	$(FLOORS_VENV)/bin/pytest -m "not slow" $(FLOORS_TESTS)
	$(FLOORS_VENV)/bin/pytest $(FLOORS_SLOW_TESTS)

# The README's and docs' measured figures, written in from benchmarks/records/ (tests/test_docs.py keeps them equal).
docs: $(VENV)/.installed
	$(BIN)/python -m benchmarks.docs

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(VENV)/.installed
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

clean:
	rm -rf runs outputs .pytest_cache
