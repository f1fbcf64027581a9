"""What the launch made of the run's processes (DeepSpeed and its ZeRO stage, FSDP2, mixed
precision) and the facts that follow from it, defined once: every module that asks whether
the weights are sharded, who places them, or whether DeepSpeed trains half-precision copies
reads a `Topology` instead of comparing `accelerator.distributed_type` itself.

`Topology.of(accelerator)` is pure and cheap (three attributes of the Accelerator), so a
caller takes it where it needs it rather than having it passed down: the Accelerator's
distributed type, plugins and precision are fixed once `launch.setup_accelerator` returns
(`launch.check_topology`, through `fsdp_on_cpu`, is the last to change them, and reads the
launch itself for that reason). An object that lives for the run (`backend.Backend`) takes
it once and keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelerate.utils import DistributedType


@dataclass(frozen=True)
class Topology:
    deepspeed: bool
    """DeepSpeed's engine runs the step (any ZeRO stage)."""
    zero_stage: int | None
    """DeepSpeed's ZeRO stage; None without DeepSpeed."""
    fsdp: bool
    """PyTorch's FSDP2 (FSDP1 is refused at launch)."""
    mixed_precision: str
    """Accelerate's mixed precision: "no", "fp16", "bf16" (or "fp8")."""

    @classmethod
    def of(cls, accelerator) -> Topology:
        kind = accelerator.distributed_type
        deepspeed = kind == DistributedType.DEEPSPEED
        plugin = accelerator.state.deepspeed_plugin if deepspeed else None
        return cls(
            deepspeed=deepspeed,
            zero_stage=plugin.zero_stage if plugin is not None else None,
            fsdp=kind == DistributedType.FSDP,
            mixed_precision=accelerator.mixed_precision,
        )

    @property
    def zero3(self) -> bool:
        """DeepSpeed ZeRO-3: the weights are partitioned across processes."""
        return self.zero_stage == 3

    @property
    def sharded(self) -> bool:
        """Each process holds only a shard of the weights (ZeRO-3 or FSDP2)."""
        return self.fsdp or self.zero3

    @property
    def places_weights(self) -> bool:
        """The backend places the weights itself in `prepare` (DeepSpeed, FSDP2; with
        offload it keeps them off the GPU)."""
        return self.deepspeed or self.fsdp

    @property
    def fp16(self) -> bool:
        """fp16 mixed precision, with its loss scaler (Accelerate's, or DeepSpeed's own)."""
        return self.mixed_precision == "fp16"

    @property
    def half_engine(self) -> bool:
        """DeepSpeed trains half-precision copies of the weights (bf16 or fp16 mixed
        precision), keeping the float32 masters in its optimizer."""
        return self.deepspeed and self.mixed_precision in ("bf16", "fp16")
