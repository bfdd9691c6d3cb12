"""Phase 2: training the DSpark draft stages against the frozen target, and measuring acceptance.

The draft is the engine's own ``DSparkDraft`` on the reference ``Kernels`` (their
ops are plain differentiable PyTorch), so what is trained is exactly what the
engine runs. The frozen transformers target supplies, per training window, the
hidden states of the ``dspark_target_layer_ids`` layers (mean of each layer's
output streams) and its next-token distributions. Half the windows are training
text ending in a few of the target's greedy tokens (anchored on the real text,
and one at the first greedy token: the engine's first draft after a prefill),
the rest the target's own long greedy continuations of training prompts. A block
position is trained only where the target's argmax there is what its greedy continuation would produce,
as in the greedy verification the draft is measured against.

The confidence head's per-position temperatures are then fitted on text the draft did not train on
(``fit_temperatures``), and acceptance is measured on held-out text as greedy speculative decoding meets it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.common.dspark import DEFAULT_CONTEXT_WINDOW, DSparkConfig, DSparkDraft
from deepinfer_interfaces import Kernels

from .data import fixed_windows, random_windows


#: the bundled draft's stage count (``mtp.0..2``, as V4-Flash-DSpark): config.json leaves it to the checkpoint's prefixes
NUM_STAGES = 3


def dspark_fields(num_layers: int, noise_id: int, window: int, markov_rank: int) -> dict:
    """The ``dspark_*`` config.json fields of the bundled draft, as the release spells them: a block of five over the
    middle and last target layers; the context window only where it is not the default 128."""
    fields = dict(
        dspark_block_size=5,
        dspark_target_layer_ids=[num_layers // 2 - 1, num_layers - 1],
        dspark_noise_token_id=noise_id,
        dspark_markov_rank=markov_rank,
        num_nextn_predict_layers=NUM_STAGES,
    )
    if window != DEFAULT_CONTEXT_WINDOW:
        fields["dspark_context_window"] = window
    return fields


class FrozenTarget:
    """The transformers target, with forward hooks collecting the draft's target-layer hidden states."""

    def __init__(self, hf_model, layer_ids: list[int]) -> None:
        self.model = hf_model.eval().requires_grad_(False)
        self.layer_ids = layer_ids
        self._out: dict[int, torch.Tensor] = {}
        self._handles = [hf_model.model.layers[i].register_forward_hook(self._keep(i)) for i in layer_ids]

    def _keep(self, i: int):
        def hook(_module, _inputs, output) -> None:
            self._out[i] = (output[0] if isinstance(output, tuple) else output).mean(dim=2)

        return hook

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, S]`` tokens → (``[B, S, V]`` logits, ``[B, S, L, D]`` target-layer hidden states)."""
        logits = self.model(input_ids=x, use_cache=False).logits
        hidden = torch.stack([self._out[i] for i in self.layer_ids], dim=2)
        self._out.clear()
        return logits, hidden

    @torch.no_grad()
    def greedy(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        """``[B, S + steps]``: ``x`` followed by the target's greedy continuation (decoded through transformers' cache)."""
        out = self.model(input_ids=x, use_cache=True)
        for i in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt], dim=1)
            if i + 1 < steps:
                out = self.model(input_ids=nxt, cache=out.cache, use_cache=True)
        self._out.clear()
        return x

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def init_draft(draft: DSparkDraft, target: DeepseekV4Model, gen: torch.Generator) -> None:
    """Warm start: each stage copies the target's sliding layer's attention and a routed layer's MoE and mHC; heads start small."""
    tparams = target.named_parameters()
    routed = [i for i, t in enumerate(target.config.mlp_layer_types) if t == "moe"]
    sliding = target.config.layer_types.index("sliding_attention")
    with torch.no_grad():
        for s, stage in enumerate(draft.stages):
            src_ffn = routed[s % len(routed)]
            for name, p in stage.named_parameters().items():
                if name.startswith(("main_", "hc_head", "norm.", "markov_head", "confidence_head")):
                    continue
                layer = sliding if name.startswith("attn.") else src_ffn
                p.copy_(tparams[f"model.layers.{layer}.{name}"])
        width = draft.main_proj.shape[1]
        draft.main_norm.fill_(1.0)
        draft.main_proj.copy_(torch.randn(draft.main_proj.shape, generator=gen) * width**-0.5)
        draft.hc_fn.copy_(tparams["model.hc_head.hc_fn"])
        draft.hc_base.copy_(tparams["model.hc_head.hc_base"])
        draft.hc_scale.copy_(tparams["model.hc_head.hc_scale"])
        draft.norm.copy_(tparams["model.norm.weight"])
        draft.markov_w1.copy_(torch.randn(draft.markov_w1.shape, generator=gen) * 0.02)
        draft.markov_w2.zero_()
        draft.conf_w.zero_()


def trainable(draft: DSparkDraft) -> list[torch.Tensor]:
    """The draft's leaf tensors (stacked expert weights once, not their per-expert views), made trainable."""
    leaves: dict[int, torch.Tensor] = {}
    for t in draft.named_parameters().values():
        base = t._base if t._base is not None else t
        leaves[id(base)] = base
    out = [t for t in leaves.values() if t.is_floating_point()]
    for t in out:
        t.requires_grad_(True)
    return out


def ring_rows(batch: int, seq_len: int, anchors: torch.Tensor, window: int) -> torch.Tensor:
    """``[B·A, W]`` rows of a ``[B·S]`` context pool each anchor sees: positions ``[t − W, t)`` of its own window."""
    offs = torch.arange(window) - window  # -W .. -1
    pos = anchors[:, :, None] + offs  # [B, A, W]
    rows = torch.arange(batch)[:, None, None] * seq_len + pos
    return torch.where(pos >= 0, rows, torch.full_like(rows, -1)).reshape(-1, window)


def anchored_blocks(draft: DSparkDraft, x: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """The draft's inputs for the blocks anchored at ``anchors`` ``[B, A]`` of windows ``x`` ``[B, S]`` (their
    target-layer hidden states ``[B, S, layers, D]``): the arguments of ``DSparkDraft.hidden`` / ``draft``, and
    each block's window index and anchor position ``[B·A]``. The anchor's own hidden state is not context: the
    engine drafts from a token the target has sampled but not yet run."""
    b, s = x.shape
    ctx = draft.context(hidden.reshape(b * s, *hidden.shape[2:]))
    ctx_kv = draft.context_kv(ctx, torch.arange(s).repeat(b))
    rows = ring_rows(b, s, anchors, draft.config.dspark_context_window)
    bi = torch.arange(b)[:, None].expand_as(anchors).reshape(-1)
    t = anchors.reshape(-1)
    return (x[bi, t], t, ctx_kv, rows), bi, t


def block_loss(draft: DSparkDraft, x: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the blocks anchored at ``anchors`` ``[B, A]``: the draft loss (cross-entropy on the target's argmax
    plus half the KL to its distribution), the confidence head's loss, and the per-position hit rate.

    Block position ``i`` is trained only while the window's tokens after the anchor equal the target's argmax
    at positions ``0..i−1``: only then is the target's argmax at position ``i`` the token its greedy
    continuation would produce there (always so on greedy text; on real text, for a prefix of the block).
    The confidence head learns whether position ``i``'s greedy draft is the target's token where the draft's
    positions ``0..i−1`` were (it estimates survival given survival so far), from the hidden state (detached:
    it does not shape the draft) and the previous token, which is then the target's.
    """
    g = draft.config.dspark_block_size
    inputs, bi, t = anchored_blocks(draft, x, hidden, anchors)
    h = draft.hidden(*inputs)  # [N, g, D]
    span = t[:, None] + torch.arange(g)  # positions whose next token each block position proposes
    teacher = logits[bi[:, None], span]  # [N, g, V]
    labels = teacher.argmax(-1)
    agree = (x[bi[:, None], span + 1] == labels).float()
    valid = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1].cumprod(dim=1)], dim=1)
    prev = torch.cat([x[bi, t][:, None], labels[:, :-1]], dim=1)
    out = draft.logits(h, prev)
    logp = F.log_softmax(out, dim=-1)
    kl = F.kl_div(logp, F.log_softmax(teacher, dim=-1), log_target=True, reduction="none").sum(-1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]
    loss = ((0.5 * kl + ce) * valid).sum() / valid.sum()
    with torch.no_grad():
        hit = (logp.argmax(-1) == labels).float()
        survived = valid * torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1].cumprod(dim=1)], dim=1)
    bce = F.binary_cross_entropy_with_logits(draft.accept_logit(h.detach(), prev), hit, reduction="none")
    conf = (bce * survived).sum() / survived.sum().clamp_min(1)
    return loss, conf, (hit * valid).sum(0) / valid.sum(0).clamp_min(1)


def real_with_tails(frozen: "FrozenTarget", train_ids: torch.Tensor, n: int, seq_len: int, tail: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` windows of ``seq_len − tail`` training tokens, each followed by the target's ``tail`` greedy tokens."""
    prompts = random_windows(train_ids, n, seq_len - tail, gen)
    return frozen.greedy(prompts, tail)


def train_dspark(target_hf, target: DeepseekV4Model, draft: DSparkDraft, train_ids: torch.Tensor, *, steps: int, batch: int,
                 seq_len: int, anchors: int, lr: float, seed: int, generated: int, real: int, tail: int,
                 log_every: int = 20) -> list[dict]:
    """Train the draft on real windows ending in the target's greedy tokens and on its long greedy continuations.

    Each step takes ``real`` training windows whose last ``tail`` tokens are the target's greedy continuation
    of the rest (one anchor at the first greedy token, where the engine drafts after a prefill, the others
    anywhere on the real text) and ``batch − real`` long greedy continuations (anchors from the last prompt token on).
    """
    gen = torch.Generator().manual_seed(seed)
    frozen = FrozenTarget(target_hf, draft.config.dspark_target_layer_ids)
    g = draft.config.dspark_block_size
    start = time.monotonic()
    # greedy continuations of real prompts whose length varies by generation batch, so anchors range
    # from the last real token deep into the target's own text
    lengths = [max(seq_len * (2 + i % 6) // 16, 1) for i in range(0, generated, 32)]
    synthetic, prompt_lens = [], []
    for i, p_len in zip(range(0, generated, 32), lengths):
        prompts = random_windows(train_ids, min(32, generated - i), p_len, gen)
        synthetic.append(frozen.greedy(prompts, seq_len - p_len))
        prompt_lens += [p_len] * prompts.shape[0]
    synthetic, prompt_lens = torch.cat(synthetic), torch.tensor(prompt_lens)
    print(f"dspark: {generated} greedy continuations of the target generated in {time.monotonic() - start:.0f}s", flush=True)
    params = trainable(draft)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    log = []
    try:
        for step in range(steps):
            for grp in opt.param_groups:
                grp["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
            reals = real_with_tails(frozen, train_ids, real, seq_len, tail, gen)
            pick = torch.randint(0, synthetic.shape[0], (batch - real,), generator=gen)
            x = torch.cat([reals, synthetic[pick]])
            logits, hidden = frozen(x)
            # real windows: anchors anywhere on the real text, the first at its last token; synthetic: from the
            # last prompt token on, that one always
            low = torch.cat([torch.ones(real, dtype=torch.long), prompt_lens[pick] - 1])
            high = torch.cat([torch.full((real,), seq_len - tail), torch.full((batch - real,), seq_len - g)])
            u = torch.rand(x.shape[0], anchors, generator=gen)
            a = low[:, None] + (u * (high - low)[:, None].float()).long()
            a[:real, 0] = seq_len - tail
            a[real:, 0] = low[real:]
            kl, conf, hit = block_loss(draft, x, logits, hidden, a)
            (kl + conf).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % log_every == 0 or step == steps - 1:
                entry = dict(step=step, kl=kl.item(), confidence_bce=conf.item(), hit=[round(v, 3) for v in hit.tolist()],
                             seconds=time.monotonic() - start)
                log.append(entry)
                print(f"dspark step {step:4d}  KL {entry['kl']:.3f}  conf {entry['confidence_bce']:.3f}  "
                      f"hit/position {entry['hit']}  {entry['seconds']:.0f}s", flush=True)
    finally:
        frozen.close()
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    return log


@torch.no_grad()
def drafts_at(draft: DSparkDraft, seqs: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
              chunk: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft's pass at every anchor position ``[A]`` of every committed sequence ``[N, L]`` (target-layer
    hidden states ``[N, L, layers, D]``): ``[N, A]`` accepted lengths against the sequence's next tokens,
    ``[N, A, γ]`` predicted survival and ``[N, A, γ]`` the confidence head's logits (before temperatures)."""
    n = seqs.shape[0]
    g = draft.config.dspark_block_size
    accepted = torch.zeros(n, anchors.numel(), dtype=torch.long)
    confidence = torch.zeros(n, anchors.numel(), g)
    logits = torch.zeros(n, anchors.numel(), g)
    for i in range(0, n, chunk):
        x = seqs[i : i + chunk]
        b = x.shape[0]
        inputs, bi, t = anchored_blocks(draft, x, hidden[i : i + chunk], anchors[None].expand(b, -1))
        out = draft.draft(*inputs)
        truth = x[bi[:, None], t[:, None] + 1 + torch.arange(g)]
        accepted[i : i + b] = (out.tokens == truth).long().cumprod(dim=1).sum(1).view(b, -1)
        confidence[i : i + b] = out.confidence.float().view(b, -1, g)
        prev = torch.cat([inputs[0][:, None], out.tokens[:, :-1]], dim=1)
        logits[i : i + b] = draft.accept_logit(draft.hidden(*inputs), prev).view(b, -1, g)
    return accepted, confidence, logits


def decoding_passes(accepted: torch.Tensor, continuation: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The passes greedy speculative decoding makes through the target's continuations ``[N, G]`` of N prompts.

    ``accepted`` ``[N, A]`` is the accepted length of a pass anchored on each of the first ``A`` continuation
    tokens. The first pass anchors on token 0 (sampled by the prefill), each next one on the token verification
    adds after the accepted ones; generation ends at the first ``eos_id``, and drafted tokens past it do not
    count. Returns each pass's row, anchor index and accepted length.
    """
    n, g = continuation.shape
    is_eos = continuation == eos_id
    ends = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((n,), g))
    rows, cols, lengths = [], [], []
    for row in range(n):
        end, a = int(ends[row]), 0
        while a < min(end, accepted.shape[1]):
            k = min(int(accepted[row, a]), end - a)
            rows.append(row)
            cols.append(a)
            lengths.append(k)
            a += k + 1
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)


@dataclass
class Passes:
    """The draft passes greedy speculative decoding makes after a set of prompts."""

    prompts: int
    #: ``[P]`` each pass's anchor index in its continuation (0: the first pass after the prompt)
    anchor: torch.Tensor
    #: ``[P]`` accepted drafted tokens
    accepted: torch.Tensor
    #: ``[P, γ]`` predicted survival of each position
    confidence: torch.Tensor
    #: ``[P, γ]`` the confidence head's logits (before temperatures)
    logits: torch.Tensor


@torch.no_grad()
def chained_passes(target_hf, draft: DSparkDraft, ids: torch.Tensor, seq_len: int, eos_id: int,
                   limit: int | None = None, generate: int = 64) -> Passes:
    """The passes after each window of ``seq_len`` tokens of ``ids``, a prompt the target continues greedily for
    ``generate`` tokens. Greedy verification commits exactly that continuation whatever is drafted, so one
    target pass over prompt and continuation gives the context of every draft. The passes are chained as in
    decoding: the first anchors on the token sampled by the prefill, each next one on the token verification
    adds after the accepted ones, until the continuation reaches ``eos_id`` (tokens drafted past it do not
    count) or fewer than ``γ`` of its tokens remain."""
    g = draft.config.dspark_block_size
    frozen = FrozenTarget(target_hf, draft.config.dspark_target_layer_ids)
    try:
        seqs = frozen.greedy(fixed_windows(ids, seq_len, limit), generate)
        _, hidden = frozen(seqs)
    finally:
        frozen.close()
    accepted, confidence, logits = drafts_at(draft, seqs, hidden, torch.arange(seq_len, seqs.shape[1] - g))
    rows, cols, passes = decoding_passes(accepted, seqs[:, seq_len:], eos_id)
    return Passes(seqs.shape[0], cols, passes, confidence[rows, cols], logits[rows, cols])


def fit_temperatures(passes: Passes, grid: int = 241) -> list[float]:
    """Per block position ``i`` in turn, the temperature ``T_i`` of the confidence logits under which the mean
    predicted survival of ``passes`` at ``i`` (the running product of ``sigmoid(logit_j / T_j)``, ``j ≤ i``) is
    the share of them that survived ``i``. Admission counts a draft's survival probabilities as its expected
    accepted tokens, so that mean is what it needs right."""
    temps = torch.logspace(math.log10(0.2), math.log10(5.0), grid)
    out, running = [], torch.ones(passes.logits.shape[0])
    for i in range(passes.logits.shape[1]):
        observed = (passes.accepted > i).float().mean()
        gaps = torch.stack([((running * torch.sigmoid(passes.logits[:, i] / t)).mean() - observed).abs() for t in temps])
        t = round(temps[int(gaps.argmin())].item(), 4)
        out.append(t)
        running = running * torch.sigmoid(passes.logits[:, i] / t)
    return out


def acceptance(target_hf, draft: DSparkDraft, heldout_ids: torch.Tensor, seq_len: int, eos_id: int,
               limit: int | None = None, generate: int = 64) -> dict:
    """Offline acceptance at temperature 0, pass by pass as greedy speculative decoding meets it
    (``chained_passes`` after each held-out window). The accepted length of a pass is the number of leading
    drafted tokens equal to the target's; calibration compares, per position, the mean predicted survival
    with the share of passes that got past it (``survival_predicted_uncalibrated``: with every temperature 1).
    ``first_pass_*`` covers the first pass after each prompt alone.
    """
    g = draft.config.dspark_block_size
    p = chained_passes(target_hf, draft, heldout_ids, seq_len, eos_id, limit, generate)
    passes, predicted = p.accepted, p.confidence
    survived = torch.stack([(passes > i).float() for i in range(g)], dim=1)
    first = passes[p.anchor == 0]
    return dict(
        samples=p.prompts,
        generated_per_prompt=generate,
        draft_passes=passes.numel(),
        mean_accepted=passes.float().mean().item(),
        mean_accepted_plus_bonus=passes.float().mean().item() + 1.0,
        accepted_histogram=torch.bincount(passes, minlength=g + 1).tolist(),
        survival_observed=[round(v, 4) for v in survived.mean(0).tolist()],
        survival_predicted=[round(v, 4) for v in predicted.mean(0).tolist()],
        survival_predicted_uncalibrated=[round(v, 4) for v in torch.sigmoid(p.logits).cumprod(dim=1).mean(0).tolist()],
        confidence_temperatures=draft.confidence_temperature.tolist(),
        brier=((predicted - survived) ** 2).mean().item(),
        first_pass_mean_accepted=first.float().mean().item(),
        first_pass_histogram=torch.bincount(first, minlength=g + 1).tolist(),
    )


def describe_acceptance(acc: dict) -> str:
    """The measured acceptance as the lines the training and evaluation scripts print."""
    block_size = len(acc["accepted_histogram"]) - 1
    return (
        f"DSpark acceptance, greedy speculative decoding of {acc['generated_per_prompt']} tokens after each of "
        f"{acc['samples']} held-out prompts ({acc['draft_passes']} draft passes): mean accepted {acc['mean_accepted']:.2f} "
        f"of {block_size} drafted (+1 bonus: {acc['mean_accepted_plus_bonus']:.2f}); histogram {acc['accepted_histogram']}\n"
        f"first pass after the prompt: mean accepted {acc['first_pass_mean_accepted']:.2f}; histogram {acc['first_pass_histogram']}\n"
        f"survival per position: observed {acc['survival_observed']}, predicted {acc['survival_predicted']} "
        f"(temperatures {[round(t, 3) for t in acc['confidence_temperatures']]}; all 1: {acc['survival_predicted_uncalibrated']}), "
        f"Brier {acc['brier']:.4f}"
    )


#: config.json fields of deepinfer's earlier draft layout, which the release does not have
STALE_FIELDS = ("dspark_num_stages", "dspark_context_window", "dspark_confidence_temperatures")


def save_draft(out: Path, draft: DSparkDraft, fields: dict) -> None:
    """Put the ``mtp.*`` tensors (under the release's names) into model.safetensors, replacing any there, and the
    ``dspark_*`` fields into config.json; the target's tensors are written back unchanged."""
    from safetensors.torch import load_file, save_file

    weights = out / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(weights)).items() if not k.startswith("mtp.")}
    tensors.update({name: t.detach().clone().contiguous() for name, t in draft.named_parameters().items()})
    save_file(tensors, str(weights), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    cfg = {k: v for k, v in json.loads(cfg_path.read_text()).items() if k not in STALE_FIELDS}
    cfg.update(fields)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_draft(out: Path, fields: dict, seed: int) -> tuple[DeepseekV4Model, DSparkDraft]:
    """The engine's target loaded from ``out`` (fp32, reference kernels) and a warm-started draft over it."""
    from deepinfer.loader import read_config

    target = DeepseekV4Model.from_pretrained(out, Kernels(), dtype=torch.float32)
    raw = {k: v for k, v in read_config(out).items() if k not in STALE_FIELDS}
    raw.update(fields, dspark_num_stages=NUM_STAGES)
    draft = DSparkDraft(target, DSparkConfig.from_hf(raw, target.config))
    init_draft(draft, target, torch.Generator().manual_seed(seed))
    return target, draft
