"""The demo job: a tiny character-level GPT on a shipped corpus, plus the readers that turn a run
directory into a live view, a JSON report and plots. Nothing here talks to the services; the demo
launcher and the training loop write the run directory, these modules only read it."""
