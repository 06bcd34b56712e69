# Two commands: `make demo` (synthetic head CT -> ViT -> predictions and rollout maps) and `make test`.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
OUT ?= outputs/demo
ARGS ?=  # extra vit-ct arguments for the demo's fit and predict (tests/test_readme.py passes tiny sizes)

.PHONY: demo review test lint format clean

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

test: $(VENV)/.installed
	$(BIN)/python -m pytest

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(VENV)/.installed
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

clean:
	rm -rf runs outputs .pytest_cache
