"""The decode loop's small copies between the host and a GPU, made so that the host never waits for the device: a
blocking copy either way waits for every kernel queued before it, which would hold the next step's launch until the
last step is done. Elsewhere (a CPU) they are plain copies. And which accelerators a model spread by --device_map sits
on, for where its inputs go and whether its keys/values can sit in one device's slots.
"""

import torch


def accelerators_of(model) -> list:
    """The devices other than the host's (cpu, disk) that --device_map spread `model` over, in its map's order
    (accelerate sends the inputs to the first); none where it was not spread."""
    return [device for device in (getattr(model, "hf_device_map", None) or {}).values()
            if device not in ("cpu", "disk")]


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of `values` on `device`, copied from pinned host memory without waiting (on CUDA)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor on its way to the host: copied into pinned memory behind the work queued before it, with an
    event; tolist() waits for that copy alone (a CPU tensor is read as it is)."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(tensor.device))  # the copy's device (--device_map: any)
        else:
            self.host = tensor

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
