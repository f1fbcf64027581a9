"""What differs between processes and backends: launch.py (the Accelerator and
the launch checks), backend.py (DDP, DeepSpeed, FSDP2 and fp16 within a step),
stop.py (signals) and watchdog.py (hung ranks)."""
