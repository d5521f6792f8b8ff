"""kvtier wire contract v1: generated from the .proto files here by `python proto/generate.py`."""
