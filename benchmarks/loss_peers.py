"""The loss alone, forward + backward, against its peers in one process: ours (tiled, `naflexclip.loss`) against
siglip-kernel (fused Triton SigLIP), Inf-CL and memeff (Triton CLIP losses) and OpenCLIP's `ClipLoss` /
`SigLipLoss` (dense, and chunked where the installed open_clip has `SigLipLoss(chunk_size)`).

Every implementation gets the same `[N, D]` features (bf16 by default, L2-normalised, each text a noisy copy of
its image), the same temperature (t = 10) and, for SigLIP, bias (b = -10), as leaves that need gradients. Per
implementation: seconds of one forward + backward (median; one warm-up first, except at the largest sizes, where
a warm-up would double the cost: the record says `warmup: false`), peak memory over the inputs (CUDA max
allocated), and at the first size the loss value and the features' gradient against ours in float32, so a peer
adapter that computes something else shows. Our tile size is swept first (at the first size and dimension) and
the fastest tile is used for the rest. An implementation that ran out of memory or failed is not tried at
larger sizes; one whose time, projected from its smaller sizes as N²·D, does not fit the time left in
`--budget-s` is skipped with one line. After the first size and dimension, a torch.profiler table of ours (the
kernels with the most device time, the launches) says where its time goes. The peers are imported lazily; each
absent or failing one is skipped with one line (`pip install siglip-kernel inf-cl memeff`; they need CUDA and
Triton).

    python benchmarks/loss_peers.py --out OUT                     # GPU: N = 65,536 / 262,144 / 1,048,576
    python benchmarks/loss_peers.py --device cpu --sizes 256 512 --dims 32 --tiles 64 128   # a dry run
"""

from __future__ import annotations

import argparse
import gc
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from measure import Results, mib, synchronize, time_and_peak

from naflexclip.loss import DEFAULT_TILE_SIZE, create_loss

LOG_SCALE = 2.302585092994046  # log 10: t = 10 for both losses (SigLIP's initial t; CLIP's init is 1/0.07)
BIAS = -10.0  # SigLIP's initial bias (Zhai et al. 2023)
# pip names of the peers, by import name; the skip line says how to get each
PEER_PACKAGES = {"siglip_kernel": "siglip-kernel", "inf_cl": "inf-cl", "memeff": "memeff"}

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Unavailable(Exception):
    """An implementation that cannot run here; the message is the skip line's reason."""


@dataclass(frozen=True)
class Impl:
    name: str
    loss: str  # clip | siglip
    build: Callable[[torch.device, int], LossFn]  # (device, tile) -> fn(image, text, log_scale, bias), or raise
    fp32: bool = False  # takes float32 features instead of --dtype
    note: str = ""
    first_size_only: bool = False  # measured at the first N only
    tf32: bool = False  # fp32 GEMMs on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32) while it runs
    quadratic_memory: bool = False  # holds N×N matrices: not tried where a smaller N's peak × (N/n)² cannot fit

    @property
    def label(self) -> str:
        return f"{self.name}, fp32 features" + (" + TF32" if self.tf32 else "") if self.fp32 else self.name


def _import_peer(module: str, device: torch.device) -> Any:
    if device.type != "cuda":
        raise Unavailable(f"needs CUDA (a Triton kernel); device is {device.type}")
    try:
        return __import__(module)
    except ImportError as error:
        raise Unavailable(f"not installed ({error}); `pip install {PEER_PACKAGES[module]}` "
                          "(benchmarks/gpu_checks.py installs it from PyPI or from --wheels)") from None
    except Exception as error:  # e.g. a kernel module that asks the GPU for its capability at import
        raise Unavailable(f"import failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}") from None


def _ours(loss: str) -> Callable[[torch.device, int], LossFn]:
    def build(device: torch.device, tile: int) -> LossFn:
        loss_fn = create_loss(loss, tile)
        return lambda image, text, log_scale, bias: loss_fn(image, text, log_scale.exp(), bias)
    return build


def _siglip_kernel(device: torch.device, tile: int) -> LossFn:
    module = _import_peer("siglip_kernel", device)
    # its router: the chunked cuBLAS + Triton BCE kernel for bf16/fp16, the fully fused one for fp32; it takes
    # log t, as our models hold it
    return lambda image, text, log_scale, bias: module.fused_siglip_loss(image, text, log_scale, bias)


def _inf_cl(device: torch.device, tile: int) -> LossFn:
    cal_inf_loss = _import_peer("inf_cl", device).cal_inf_loss

    def loss(image: torch.Tensor, text: torch.Tensor, log_scale: torch.Tensor, bias: torch.Tensor | None
             ) -> torch.Tensor:
        # one direction per call (rows: q against every k), mean over rows; CLIP is the mean of both directions.
        # The temperature is folded into q here: its own `scale=` all-reduces its gradient (needs a process group)
        head_dim = next(h for h in (256, 128, 64, 32, 16) if image.shape[1] % h == 0)
        scale = log_scale.exp()
        return (cal_inf_loss(scale * image, text, head_dim=head_dim)
                + cal_inf_loss(scale * text, image, head_dim=head_dim)) / 2
    return loss


def _memeff(device: torch.device, tile: int) -> LossFn:
    module = _import_peer("memeff", device)
    # a fixed temperature (a float, no logit-scale gradient); stable=False: the textbook gradient scale, so the
    # gradients compare with ours
    loss_fn = module.MemoryEfficientCLIPLoss(temperature=float(torch.tensor(-LOG_SCALE).exp()),
                                             normalized_inputs=True, stable=False)
    return lambda image, text, log_scale, bias: loss_fn(image, text)


def _open_clip(loss: str, chunked: bool) -> Callable[[torch.device, int], LossFn]:
    def build(device: torch.device, tile: int) -> LossFn:
        import open_clip
        from open_clip import loss as oc_loss

        if loss == "clip":
            loss_fn = oc_loss.ClipLoss()
            return lambda image, text, log_scale, bias: loss_fn(image, text, log_scale.exp())
        if chunked:
            if "chunk_size" not in inspect.signature(oc_loss.SigLipLoss.__init__).parameters:
                raise Unavailable(f"the installed open_clip {open_clip.__version__} has no SigLipLoss(chunk_size) "
                                  "(OpenCLIP main's)")
            loss_fn = oc_loss.SigLipLoss(chunk_size=tile)
        else:
            loss_fn = oc_loss.SigLipLoss()
        return lambda image, text, log_scale, bias: loss_fn(image, text, log_scale.exp(), bias)
    return build


def implementations() -> list[Impl]:
    """Ours first (the reference of each row's ratios), then the peers."""
    return [
        Impl("ours", "clip", _ours("clip")),
        # the precision the window computes the loss in (fp32 GEMMs: slow at large N; the window step measures
        # it at 262,144), and the reference of the first size's loss and gradient checks
        Impl("ours", "clip", _ours("clip"), fp32=True, note="the window's loss precision", first_size_only=True),
        Impl("ours", "clip", _ours("clip"), fp32=True, tf32=True, note="what TF32 would give the window",
             first_size_only=True),
        Impl("Inf-CL", "clip", _inf_cl, note="fp32 Triton"),
        Impl("memeff", "clip", _memeff, note="fixed temperature"),
        Impl("OpenCLIP ClipLoss", "clip", _open_clip("clip", chunked=False), note="dense", quadratic_memory=True),
        Impl("ours", "siglip", _ours("siglip")),
        Impl("ours", "siglip", _ours("siglip"), fp32=True, note="the window's loss precision", first_size_only=True),
        Impl("ours", "siglip", _ours("siglip"), fp32=True, tf32=True, note="what TF32 would give the window",
             first_size_only=True),
        Impl("siglip-kernel", "siglip", _siglip_kernel),
        Impl("OpenCLIP SigLipLoss", "siglip", _open_clip("siglip", chunked=False), note="dense",
             quadratic_memory=True),
        # projected like the dense one (autograd keeps each chunk's logits for the backward); its peak says
        Impl("OpenCLIP SigLipLoss(chunk_size)", "siglip", _open_clip("siglip", chunked=True), note="chunked",
             quadratic_memory=True),
    ]


def make_inputs(n: int, dim: int, dtype: torch.dtype, device: torch.device, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit image rows and unit text rows that are noisy copies of them (matching pairs score higher)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    image = F.normalize(torch.randn(n, dim, generator=gen, device=device), dim=-1)
    text = F.normalize(image + torch.randn(n, dim, generator=gen, device=device), dim=-1)
    return image.to(dtype), text.to(dtype)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


class LossBench:
    def __init__(self, args: argparse.Namespace, results: Results) -> None:
        self.args = args
        self.results = results
        self.device = torch.device(args.device)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.deadline = time.monotonic() + args.budget_s
        self.tile = {kind: args.tile or DEFAULT_TILE_SIZE for kind in ("clip", "siglip")}
        self.failed: dict[tuple[str, str], str] = {}  # (impl, loss) -> why it is not tried again
        self.seen: dict[tuple[str, str], tuple[int, int, float]] = {}  # (impl, loss) -> (N, D, s per run)
        self.peaks: dict[tuple[str, str], tuple[int, int]] = {}  # (impl, loss) -> (N, peak bytes), N×N ones only
        # (loss, N, D) -> (value, image-feature gradient) of ours on fp32 features, at the first size
        self.reference: dict[tuple[str, int, int], tuple[float, torch.Tensor]] = {}

    def _runs(self, n: int) -> tuple[bool, int]:
        """(warm-up, timed runs) at size n: fewer where one run is long."""
        if n <= self.args.sizes[0]:
            return True, self.args.repeats
        return (True, 1) if n <= self.args.sizes[min(1, len(self.args.sizes) - 1)] else (False, 1)

    def _predicted(self, key: tuple[str, str], n: int, dim: int, runs: int) -> float | None:
        if key not in self.seen:
            return None
        n0, d0, seconds = self.seen[key]
        return seconds * runs * (n / n0) ** 2 * (dim / d0)

    def measure(self, impl: Impl, n: int, dim: int, inputs: dict, tile: int, label: str | None = None,
                compare: bool = True, grads: list | None = None) -> dict | None:
        """One implementation at (N, D): its record (also written), or None when skipped."""
        key = (label or impl.label, impl.loss)
        what = f"{key[0]} ({impl.loss}) at N={n}, D={dim}"
        if key in self.failed:
            self.results.skip(what, self.failed[key])
            return None
        if impl.first_size_only and n != self.args.sizes[0]:
            return None
        warmup, repeats = self._runs(n)
        predicted = self._predicted(key, n, dim, repeats + warmup)
        left = self.deadline - time.monotonic()
        if predicted is not None and predicted > left:
            self.results.skip(what, f"projected {predicted:.0f} s (N²·D from its smaller sizes) > {left:.0f} s left "
                                    f"of --budget-s")
            return None
        if key in self.peaks and self.device.type == "cuda":  # the N×N matrices: a smaller N's peak × (N/n)²
            n0, peak0 = self.peaks[key]
            projected, total = peak0 * (n / n0) ** 2, torch.cuda.get_device_properties(self.device).total_memory
            if projected > total:
                self.failed[key] = f"projected {projected / 2**30:.0f} GiB (its N×N matrices) > the device's " \
                                   f"{total / 2**30:.0f} GiB at N={n}"
                self.results.skip(what, self.failed[key])
                return None
        try:
            fn = impl.build(self.device, tile)
        except Unavailable as why:
            self.failed[key] = str(why)
            self.results.skip(what, str(why))
            return None
        image, text = inputs["fp32" if impl.fp32 else "low"]
        log_scale = torch.tensor(LOG_SCALE, device=self.device, requires_grad=True)
        bias = torch.tensor(BIAS, device=self.device, requires_grad=True) if impl.loss != "clip" else None
        leaves = [t for t in (image, text, log_scale, bias) if t is not None]
        values: list[torch.Tensor] = []

        def step() -> None:
            for leaf in leaves:
                leaf.grad = None
            loss = fn(image, text, log_scale, bias)
            loss.backward()
            values.append(loss.detach())

        record: dict[str, Any] = dict(kind="loss", impl=key[0], loss=impl.loss, n=n, dim=dim,
                                      dtype="fp32" if impl.fp32 else self.args.dtype, note=impl.note,
                                      tile=tile if key[0].startswith("ours") or "chunk" in key[0] else None,
                                      warmup=warmup, runs=repeats, device=str(self.device))
        failure = None
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = impl.tf32 or tf32
        try:
            seconds, peak = time_and_peak(step, self.device, repeats, warmup=warmup)
        except Exception as error:  # a peer's kernel may fail on this device or shape: one line, go on
            failure = "oom" if _is_oom(error) else f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        if failure is not None:  # out of the except block: its traceback no longer holds the step's tensors
            self.failed[key] = f"{failure} at N={n}, D={dim}"
            for leaf in leaves:
                leaf.grad = None
            values.clear()
            _free(self.device)
            self.results.record(f"| {impl.loss} | {n} | {dim} | {key[0]} | {failure} |", **record, status=failure)
            return None
        self.seen[key] = (n, dim, seconds)
        if impl.quadratic_memory and peak is not None:
            self.peaks[key] = (n, peak)
        record.update(status="ok", seconds=seconds, peak_bytes=peak, loss_value=float(values[-1].float()))
        checked = (impl.loss, n, dim)
        if compare and n == self.args.sizes[0] and impl.name == "ours" and impl.fp32 and not impl.tf32:
            self.reference[checked] = (record["loss_value"], image.grad.detach().float().clone())
        elif compare and checked in self.reference:
            value, grad = self.reference[checked]
            record["loss_rel_diff"] = abs(record["loss_value"] - value) / abs(value)
            record["grad_rel_diff"] = float((image.grad.float() - grad).norm() / grad.norm())
        if grads is not None:
            grads.append(image.grad.detach().float().clone())
        for leaf in leaves:
            leaf.grad = None
        values.clear()
        _free(self.device)
        return record

    def write_row(self, record: dict, ours: dict | None) -> None:
        versus_time = f"{record['seconds'] / ours['seconds']:.2f}" if ours else ""
        versus_mem = (f"{record['peak_bytes'] / ours['peak_bytes']:.2f}"
                      if ours and record["peak_bytes"] is not None and ours["peak_bytes"] else "")
        check = (f"{record['loss_rel_diff']:.1e} / {record['grad_rel_diff']:.1e}" if "loss_rel_diff" in record
                 else "")
        tile = f" (tile {record['tile']})" if record.get("tile") else ""
        self.results.record(
            f"| {record['loss']} | {record['n']} | {record['dim']} | {record['impl']}{tile} | "
            f"{record['seconds'] * 1e3:.1f} | {versus_time} | {mib(record['peak_bytes'])} | {versus_mem} | {check} | "
            f"{record['dtype']}{', ' + record['note'] if record['note'] else ''}"
            f"{'' if record['warmup'] else ', one run, no warm-up'} |", **record)

    def sweep_tiles(self, n: int, dim: int) -> None:
        self.results.line(f"\n### our tile size, N = {n}, D = {dim}, {self.args.dtype}, {self.device}")
        self.results.line("| loss | tile | ms | peak MiB |\n| --- | --- | --- | --- |")
        inputs = {"low": [t.requires_grad_() for t in make_inputs(n, dim, self.dtype, self.device)]}
        for kind in ("clip", "siglip"):
            best = None
            for tile in self.args.tiles:
                impl = Impl("ours", kind, _ours(kind))
                record = self.measure(impl, n, dim, inputs, tile, label=f"ours tile {tile}", compare=False)
                if record is None:
                    continue
                self.results.record(f"| {kind} | {tile} | {record['seconds'] * 1e3:.1f} | "
                                    f"{mib(record['peak_bytes'])} |", **{**record, "kind": "loss_tile"})
                if best is None or record["seconds"] < best[1]:
                    best = (tile, record["seconds"])
            if best is not None and not self.args.tile:
                self.tile[kind] = best[0]
                self.results.record(f"{kind}: fastest tile {best[0]} ({best[1] * 1e3:.1f} ms), used below",
                                    kind="loss_tile_choice", loss=kind, tile=best[0], n=n, dim=dim)
        del inputs
        _free(self.device)

    def compare(self, n: int, dim: int) -> None:
        self.results.line(f"\n### N = {n}, D = {dim}, {self.device}")
        self.results.line("| loss | N | D | implementation | ms | × ours | peak MiB | × ours | Δloss / Δgrad vs ours "
                          "fp32 | inputs |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        low = make_inputs(n, dim, self.dtype, self.device)
        inputs = {"low": [t.requires_grad_() for t in low]}
        if n == self.args.sizes[0]:  # the same values, widened: ours as the window computes it, and the reference
            inputs["fp32"] = [t.detach().float().clone().requires_grad_() for t in low]
        for kind in ("clip", "siglip"):
            ours = None
            impls = [impl for impl in implementations() if impl.loss == kind]
            # the fp32 reference first, so every row of the first size carries its check
            impls.sort(key=lambda impl: not (impl.name.startswith("ours") and impl.fp32))
            for impl in impls:
                record = self.measure(impl, n, dim, inputs, self.tile[kind])
                if record is None:
                    continue
                if impl.name == "ours" and not impl.fp32:
                    ours = record
                self.write_row(record, ours if record is not ours else None)
        del inputs
        _free(self.device)

    def profile(self, n: int, dim: int) -> None:
        """Where our loss's time goes at (N, D): torch.profiler over one forward + backward (after a warm-up), the
        kernels with the most device time, and the launches; the answer to "why slower than a fused kernel"."""
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as run_profiler

        if time.monotonic() > self.deadline - 10:
            self.results.skip(f"the profile of ours at N={n}, D={dim}", "no time left of --budget-s")
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        inputs = [t.requires_grad_() for t in make_inputs(n, dim, self.dtype, self.device)]
        for kind in ("clip", "siglip"):
            fn = _ours(kind)(self.device, self.tile[kind])
            log_scale = torch.tensor(LOG_SCALE, device=self.device, requires_grad=True)
            bias = torch.tensor(BIAS, device=self.device, requires_grad=True) if kind == "siglip" else None

            def step(fn: LossFn = fn, log_scale: torch.Tensor = log_scale, bias: torch.Tensor | None = bias) -> None:
                fn(*inputs, log_scale, bias).backward()
                synchronize(self.device)

            step()
            with run_profiler(activities=activities) as prof:
                step()
            events = prof.key_averages()
            device_time = "self_cpu_time_total"
            if self.device.type == "cuda":  # torch < 2.4 named it after CUDA
                device_time = next(name for name in ("self_device_time_total", "self_cuda_time_total")
                                   if hasattr(events[0], name))
            top = sorted(events, key=lambda e: getattr(e, device_time, 0), reverse=True)[:12]
            total = sum(getattr(e, device_time, 0) for e in events)
            launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
            self.results.line(f"\n### profile: ours ({kind}, tile {self.tile[kind]}), N = {n}, D = {dim}, one forward "
                              f"+ backward: {total / 1e3:.1f} ms of {'device' if self.device.type == 'cuda' else 'CPU'}"
                              f" time in {launches} kernel launches")
            self.results.line("| op / kernel | self ms | share | calls |\n| --- | --- | --- | --- |")
            for event in top:
                spent = getattr(event, device_time, 0)
                self.results.line(f"| {event.key[:90]} | {spent / 1e3:.2f} | {spent / max(total, 1):.1%} | "
                                  f"{event.count} |")
            self.results.record(None, kind="loss_profile", loss=kind, n=n, dim=dim, tile=self.tile[kind],
                                total_ms=total / 1e3, launches=launches,
                                top=[(e.key, getattr(e, device_time, 0) / 1e3, e.count) for e in top])
        inputs.clear()
        _free(self.device)

    def multi_positive(self, n: int, dim: int, captions: int = 2) -> None:
        """SigLIP+ (several captions per image: `n` images, `captions`·n texts, group ids): ours
        (`MultiPositiveLoss("siglip", "symmetric")`) against siglip-kernel's `fused_siglip_plus_loss`. Their
        normalisations may differ, so the check is the cosine of the image gradients and the ratio of the losses."""
        try:
            from naflexclip.loss import MultiPositiveLoss
        except ImportError:
            self.results.skip("SigLIP+ (multi-positive)", "not in this version (no naflexclip.loss.MultiPositiveLoss)")
            return
        gen = torch.Generator(device=self.device).manual_seed(1)
        image = F.normalize(torch.randn(n, dim, generator=gen, device=self.device), dim=-1)
        text = F.normalize(image.repeat_interleave(captions, 0)
                           + torch.randn(n * captions, dim, generator=gen, device=self.device), dim=-1)
        image_groups = torch.arange(n, device=self.device)
        text_groups = image_groups.repeat_interleave(captions)
        inputs = {"low": [image.to(self.dtype).requires_grad_(), text.to(self.dtype).requires_grad_()]}

        def ours(device: torch.device, tile: int) -> LossFn:
            loss_fn = MultiPositiveLoss("siglip", "symmetric", tile)
            return lambda i, t, log_scale, bias: loss_fn(i, t, log_scale.exp(), bias, image_groups, text_groups)

        def fused(device: torch.device, tile: int) -> LossFn:
            module = _import_peer("siglip_kernel", device)
            return lambda i, t, log_scale, bias: module.fused_siglip_plus_loss(
                i, t, log_scale, bias, image_groups, text_groups, symmetric=True, num_groups=n)

        self.results.line(f"\n### SigLIP+ (multi-positive), N = {n} images, M = {n * captions} texts ({captions} per "
                          f"image), D = {dim}, symmetric weighting, {self.args.dtype}, {self.device}; siglip-kernel "
                          f"divides the sum by N·M, ours by N: its loss should be ours × {1 / (n * captions):.3g}")
        self.results.line("| implementation | ms | × ours | peak MiB | × ours | loss | grad cosine vs ours |\n"
                          "| --- | --- | --- | --- | --- | --- | --- |")
        first: dict | None = None
        grads: list[torch.Tensor] = []
        for impl in (Impl("ours MultiPositiveLoss", "siglip+", ours), Impl("siglip-kernel SigLIP+", "siglip+", fused)):
            record = self.measure(impl, n, dim, inputs, self.tile["siglip"], compare=False, grads=grads)
            if record is None:
                continue
            first = first or record
            versus = record["seconds"] / first["seconds"]
            memory = (record["peak_bytes"] / first["peak_bytes"]) if record["peak_bytes"] and first["peak_bytes"] \
                else None
            cosine = float(F.cosine_similarity(grads[-1].flatten(), grads[0].flatten(), dim=0))
            self.results.record(
                f"| {impl.name} | {record['seconds'] * 1e3:.1f} | {versus:.2f} | {mib(record['peak_bytes'])} | "
                f"{'' if memory is None else f'{memory:.2f}'} | {record['loss_value']:.4f} | {cosine:.5f} |",
                **{**record, "kind": "loss_multi_positive"}, texts=n * captions, time_ratio=versus,
                memory_ratio=memory, grad_cosine=cosine, loss_ratio=record["loss_value"] / first["loss_value"],
                expected_loss_ratio=1.0 if record is first else 1 / (n * captions))
        inputs.clear()
        grads.clear()
        _free(self.device)

    def run(self) -> None:
        args = self.args
        self.results.record(f"loss step: {self.device}, torch {torch.__version__}, features {args.dtype}, "
                            f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, budget {args.budget_s:.0f} s",
                            kind="loss_env", device=str(self.device), torch=torch.__version__,
                            allow_tf32=torch.backends.cuda.matmul.allow_tf32, dtype=args.dtype,
                            gpu=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        if args.tiles:
            self.sweep_tiles(args.sizes[0], args.dims[0])
        for n in args.sizes:
            for dim in args.dims:
                self.compare(n, dim)
                if (n, dim) == (args.sizes[0], args.dims[0]):
                    if args.profile:
                        self.profile(n, dim)
                    self.multi_positive(n, dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 262144, 1048576], help="N pairs")
    parser.add_argument("--dims", type=int, nargs="+", default=[768, 1152], help="feature dimensions D")
    parser.add_argument("--tiles", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384],
                        help="our tile sizes to sweep at the first N and D (none: no sweep)")
    parser.add_argument("--tile", type=int, default=None, help="our tile for the comparison (default: the fastest "
                                                              "of the sweep)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="no torch.profiler table of ours at the first N and D")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs at the first size (1 at larger sizes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads (a dry run)")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip what would not finish within this")
    parser.add_argument("--out", default=None, help="append results.jsonl / results.md here as they are measured")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    LossBench(args, Results(args.out, "loss")).run()


if __name__ == "__main__":
    main()
