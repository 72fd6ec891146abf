"""hotloop API stubs generated from protos/ by scripts/gen_protos.py."""
