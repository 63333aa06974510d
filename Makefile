# rlcourse: two commands do everything.
#   make lab   - set up the environment and open the course in JupyterLab
#   make test  - set up the environment and run every test (unit tests + all notebooks)
#
# Knobs (override on the command line, e.g. `make lab TORCH="torch --index-url https://download.pytorch.org/whl/cu124"`):
PYTHON   ?= python3
VENV     ?= .venv
TORCH    ?= torch==2.13.0
LAB_ARGS ?=
PROFILE  ?= laptop
# The test suite runs the notebooks under the smaller `ci` profile; each still asserts its promise.
TEST_PROFILE ?= ci

# How OpenMP threads wait: why these two, see rlcourse/__init__.py (which sets them too).
export OMP_WAIT_POLICY := PASSIVE
export GOMP_SPINCOUNT := 1000
# Nothing in the course downloads anything.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYDEVD_DISABLE_FILE_VALIDATION := 1
export RLCOURSE_PROFILE ?= $(PROFILE)

BIN   := $(VENV)/bin
STAMP := $(VENV)/.rlcourse-installed
# JupyterLab refuses to start as root unless told it may.
ROOT_FLAG := $(shell [ "$$(id -u)" = "0" ] && echo --allow-root)

.PHONY: lab test browser env notebooks exercises bench book clean

env: $(STAMP)

# The kernel's name and display name are the committed notebooks' kernelspec (KERNELSPEC in
# rlcourse/tools/execute.py), so opening a lesson in JupyterLab does not rewrite its metadata.
# torch goes in first, from $(TORCH): installing the package first would let pip pick a default
# torch build (several GB of CUDA libraries on Linux).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (rlcourse)" >/dev/null
	# JupyterLab asks on first start whether to fetch Jupyter's news, in a toast over the lesson's
	# output; the course is offline, so the answer is given here: never.
	mkdir -p $(VENV)/share/jupyter/lab/settings
	echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' \
		> $(VENV)/share/jupyter/lab/settings/overrides.json
	touch $@

lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_FLAG) --ServerApp.root_dir="$(CURDIR)" $(LAB_ARGS) course/00_start_here.ipynb

# The lessons run under nbval; the solution notebooks run under the grader instead
# (tests/test_grading_solutions.py: every cell in a kernel, every check in its worker), which
# covers all that nbval would, so they are not executed a second time.
# TEST_WORKERS pytest-xdist workers share the files: `--dist loadfile` keeps each test file and
# each notebook (whose cells share one kernel, in order) on one worker. Each test runs mostly on
# one core, so two workers on a 2-core machine roughly halve the wall time; TEST_WORKERS=0 runs
# everything in one process.
TEST_WORKERS ?= 2
test: $(STAMP) browser
	RLCOURSE_PROFILE=$(TEST_PROFILE) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --nbval-lax tests course $(PYTEST_ARGS)

# The book's browser test (tests/test_book.py, rlcourse/tools/book/browser.py) drives the system's
# Chromium. Where there is none and apt-get may run (as root), Debian's package is installed here;
# elsewhere that test is skipped and says how to install one.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 && export DEBIAN_FRONTEND=noninteractive && \
	  { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	echo "note: no Chromium here, so the book's browser test is skipped (Debian: apt-get install chromium)"

# Re-execute the committed lesson and solution notebooks (with outputs) and regenerate exercises/.
notebooks: $(STAMP)
	$(BIN)/python -m rlcourse.tools.execute course/*.ipynb solutions/*.ipynb
	$(BIN)/python -m rlcourse.tools.make_exercises

exercises: $(STAMP)
	$(BIN)/python -m rlcourse.tools.make_exercises

bench: $(STAMP)
	$(BIN)/python -m rlcourse.bench

# The course as a static website in _build/html, from the committed notebooks (nothing re-run,
# nothing downloaded), then checked: see rlcourse/tools/book/build.py. Publish _build/html anywhere.
book: $(STAMP)
	$(BIN)/python -m rlcourse.tools.book

clean:
	rm -rf $(VENV)
