# The two commands the README promises: `make tune` (the main job) and `make test`.
# Both set everything up themselves on a fresh machine (scripts/setup.sh).
VENV ?= .venv
COLIBRI = $(VENV)/bin/colibri

.PHONY: setup tune demo test test-all fuzz clean

setup:
	@./scripts/setup.sh

# Main job: tune the engine on the built-in demo model (synthesized on first use).
tune: setup
	$(COLIBRI) tune

# Generate with the demo model, streaming under the default budget.
demo: setup
	$(COLIBRI) run --model demo --prompt-tokens 16 --max-new-tokens 16

test: setup
	$(VENV)/bin/python -m pytest -q -m "not slow" --durations=20

# A longer, random fuzz campaign than CI's bounded one (tests/test_fuzz*.py): FUZZ_EXAMPLES per
# property (fewer where an example is a batch of processes), then the outcomes per input kind,
# counted by the suite itself (FUZZ_REPORT, one JSON line per call; docs/VALIDATION.md).
FUZZ_EXAMPLES ?= 400
FUZZ_REPORT ?= fuzz-report.jsonl
fuzz: setup
	rm -f $(FUZZ_REPORT)
	COLIBRI_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) COLIBRI_FUZZ_REPORT=$(abspath $(FUZZ_REPORT)) $(VENV)/bin/python -m pytest -q tests/test_fuzz.py tests/test_fuzz_commands.py tests/test_fuzz_values.py --hypothesis-show-statistics; \
	status=$$?; $(VENV)/bin/python tests/colibri_fuzz.py $(FUZZ_REPORT); exit $$status

test-all: setup
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
