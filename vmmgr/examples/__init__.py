"""Scripts a user runs inside their VMs (the training demo copies train.py in)."""
