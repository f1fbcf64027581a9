"""What differs between processes and backends: launch.py (the Accelerator and
the launch checks), topology.py (what the launch set up, and the facts that follow:
the one place they are derived), backend.py (DDP, DeepSpeed, FSDP2 and fp16 within a
step), stop.py (signals) and watchdog.py (hung ranks)."""
