"""Seeing a run from BASE_DIR: the timeline of its rounds / generations (timeline.py: the data, draw.py: the
picture, recorder.py: what the coordinators call each round) and the status view (`python -m train.status RUN_DIR`,
view.py). Everything here only reads the run folder, except the coordinator's recorder, which appends the per-round
worker timings to timeline.jsonl (the sidecars they come from are pruned with their rounds) and writes timeline.png.
docs/status.md says how to read both."""
