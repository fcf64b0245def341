"""End to end: a Hugging Face transformers model (``MambaForCausalLM``,
``Mamba2ForCausalLM``, ``Qwen3_5ForCausalLM``, ``KimiLinearForCausalLM``,
``Lfm2ForCausalLM``, ``RecurrentGemmaForCausalLM``, ``RwkvForCausalLM`` or
``MiniMaxForCausalLM``) unpatched against patched by
:func:`parascan.integrations.transformers.patch`, on CPU::

    python -m parascan.cli.bench_transformers            # the issue's sizes (minutes)
    python -m parascan.cli.bench_transformers --model mamba2
    python -m parascan.cli.bench_transformers --model qwen3_5
    python -m parascan.cli.bench_transformers --model kimi_linear
    python -m parascan.cli.bench_transformers --quick    # a small model, seconds

A randomly initialized model, vocabulary 1024 (the vocabulary only sizes the embedding
and the head, which patching does not touch), 4 layers:

mamba        hidden 768, state 16
mamba2       hidden 768, 24 heads of 64, state 64, one group, chunk 128
qwen3_5      the text-only Qwen3.5 model, hidden 1024, MLP 3072: layers 1-3 gated delta
             rule (4 key heads and 8 value heads of 128 channels, convolution of width
             4: what the patch replaces), layer 4 full attention (8 query and 2
             key/value heads of 256, gated, partial rotary as Qwen3.5's defaults)
kimi_linear  Kimi Linear, hidden 1024, dense MLP 3072 on every layer (no mixture of
             experts): layers 1-3 Kimi Delta Attention (8 heads of 128, per-channel
             decay, convolution of width 4: what the patch replaces), layer 4
             multi-head latent attention (8 heads, key/value rank 512, no query rank)
lfm2         LFM2, hidden 768, MLP 2304: layers 1-3 gated short convolutions (width 3:
             what the patch replaces), layer 4 full attention (8 heads, 2 key/value)
recurrent_gemma  Griffin, hidden 768, gated MLP 1152 (the config's 2304, which the
             model halves): layers 1-3 recurrent (RG-LRU of width 768, convolution of
             width 4: the RG-LRU scan is what the patch replaces), layer 4 local
             attention (8 heads, 1 key/value)
rwkv         RWKV-4, hidden 768, MLP 3072: every layer's WKV recurrence (what the patch
             replaces)
minimax      MiniMax, hidden 1024, a mixture of 2 experts (MLP 3072, one a token):
             layers 1-3 lightning attention (8 heads of 128, block 256: what the patch
             replaces), layer 4 full attention (8 heads, 2 key/value)
xlstm        xLSTM, hidden 768, 8 heads (not patched: tools/matmul_floor.py measures
             how far transformers' own chunkwise mLSTM is from its linear layers)

(with ``--quick``: hidden 64, 2 layers, the first linear and the second full attention,
heads of 16 channels). One sequence, three workloads:

forward     the logits of ``tokens`` tokens (eval mode, no cache)
train step  forward, loss and backward on ``tokens`` tokens (training mode)
generate    greedy ``generate`` of ``new_tokens`` tokens after a 16-token prompt

Summary of method. Each workload runs ``repeat`` rounds (``train_repeat`` for the
training step, whose unpatched run takes minutes at full size), each round unpatched then
patched on the same model and inputs, so that a slow spell of a shared machine hits both
alike; the minimum of each variant is reported (noise only adds). On a machine
shared with other work, ``--threads 1`` gives steadier figures: a parallel region whose
second thread is descheduled stalls, and the patched backward (many short torch ops)
then varies many-fold from run to run.

The first round's results are compared: logits and every parameter's gradient to the
float32 tolerance relative to the largest unpatched magnitude, generated tokens exactly.
A workload whose results differ gets no speed-up.

For the forward and the training step, "linear s" is the time of the model's own linear
layers alone in that workload (:mod:`parascan.cli.linear_floor`: every projection a
patched run makes, timed alone, min of ``repeat``), which no patch of the scans can beat,
and "/ linear" the patched time over it: what is left above 1 is everything else the
model runs, transformers' own code included.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from parascan.cli.common import table
from parascan.cli.linear_floor import linear_calls, linear_time
from parascan.cli.tolerance import relative_error

__all__ = ["MODEL_CLASSES", "PATCHED_MODELS", "Row", "format_rows", "main", "run"]

_PROMPT = 16
_RTOL = 1e-4  # float32, after a few layers of matmuls around the scan
# the full size's hidden, where not 768
_HIDDEN = {"qwen3_5": 1024, "kimi_linear": 1024, "minimax": 1024}


@dataclass
class Row:
    name: str
    unpatched_s: float
    patched_s: float
    speedup: float | None  # unpatched / patched; None when the results differ
    max_error: float  # relative to the largest unpatched magnitude (0 for tokens)
    correct: bool
    detail: str = ""
    # the model's own linear layers alone in this workload (parascan.cli.linear_floor):
    # what no patch of the scans can beat; None for generate
    linear_s: float | None = None


@contextmanager
def _patched(on: bool) -> Iterator[None]:
    from parascan.integrations import transformers as integration

    integration.unpatch()
    if on:
        integration.patch()
    try:
        yield
    finally:
        integration.unpatch()


def run(
    *,
    quick: bool = False,
    tokens: int | None = None,
    new_tokens: int | None = None,
    hidden: int | None = None,
    layers: int | None = None,
    state: int | None = None,
    vocab: int = 1024,
    model_name: str = "mamba",
    repeat: int = 3,
    train_repeat: int = 1,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Time the three workloads unpatched and patched; returns one row each.

    Args:
        quick: a small model and short sequences (hidden 64, 2 layers, 64 tokens,
            8 new tokens) unless given explicitly: seconds, for tests.
        tokens: the sequence length of the forward and the training step (512).
        new_tokens: tokens generated (64).
        hidden, layers, state, vocab: the model (768, 1024 for the Qwen3.5, Kimi Linear
            and MiniMax models; 4; 16 for Mamba and 64 for Mamba-2, unused by the others; 1024).
        model_name: ``"mamba"`` (MambaForCausalLM), ``"mamba2"`` (Mamba2ForCausalLM,
            heads of 64 channels, chunk 128; quick: heads of 16, chunk 16),
            ``"qwen3_5"`` (Qwen3_5ForCausalLM), ``"kimi_linear"``
            (KimiLinearForCausalLM): linear-attention layers with heads of 128 key and
            value channels (quick: 16), every fourth layer and the last full attention;
            ``"lfm2"``, ``"recurrent_gemma"``, ``"rwkv"``, ``"minimax"``; see the
            module's docstring.
        repeat: timed runs of each variant of the forward and of generate; the fastest
            counts.
        train_repeat: the same for the training step.
        seed: the model's initialization and the inputs.
        progress: called with a line before each measurement.
    """
    if model_name not in PATCHED_MODELS and model_name in MODEL_CLASSES:
        raise ValueError(
            f"bench_transformers: the patch leaves {model_name!r} alone, so patched and "
            f"unpatched are the same code (tools/matmul_floor.py measures its bound); "
            f"expected one of {', '.join(map(repr, PATCHED_MODELS))}"
        )
    tokens = tokens or (64 if quick else 512)
    new_tokens = new_tokens or (8 if quick else 64)
    hidden = hidden or (64 if quick else _HIDDEN.get(model_name, 768))
    layers = layers or (2 if quick else 4)
    say = progress or (lambda line: None)

    torch.manual_seed(seed)
    model: Any = _model(model_name, hidden, layers, state, vocab, quick)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    prompt = torch.randint(0, vocab, (1, _PROMPT), generator=gen)

    def forward(ids: torch.Tensor = ids) -> list[torch.Tensor]:
        model.eval()
        with torch.no_grad():
            return [model(ids, use_cache=False).logits]

    def train_step(ids: torch.Tensor = ids) -> list[torch.Tensor]:
        model.train()
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    def generate(count: int = new_tokens) -> list[torch.Tensor]:
        model.eval()
        out = model.generate(
            prompt, max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=0
        )
        return [out]

    workloads: list[tuple[str, Callable[[], list[torch.Tensor]]]] = [
        (f"forward, {tokens} tokens", forward),
        (f"train step, {tokens} tokens", train_step),
        (f"generate {new_tokens} tokens", generate),
    ]
    # Warm up every path (first-call setup, lazy imports) on a few tokens.
    for on in (False, True):
        with _patched(on):
            forward(ids[:, :8]), train_step(ids[:, :8]), generate(2)
    rows = []
    for name, fn in workloads:
        results: dict[bool, list[torch.Tensor]] = {}
        times: dict[bool, float] = {False: float("inf"), True: float("inf")}
        for _ in range(max(1, train_repeat if fn is train_step else repeat)):
            for on in (False, True):
                say(f"{name}: {'patched' if on else 'unpatched'}")
                with _patched(on):
                    start = time.perf_counter()
                    result = fn()
                    times[on] = min(times[on], time.perf_counter() - start)
                results.setdefault(on, result)
        got, want = results[True], results[False]
        if name.startswith("generate"):
            error = 0.0 if all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) else 1.0
            correct = error == 0.0
            detail = f"{new_tokens / times[False]:.1f} -> {new_tokens / times[True]:.1f} tokens/s"
        else:
            error = max(
                relative_error(g.double(), w.double()) for g, w in zip(got, want, strict=True)
            )
            correct = error <= _RTOL
            detail = ""
        linear = None
        if not name.startswith("generate"):
            say(f"{name}: the linear layers alone")
            with _patched(True):
                calls = linear_calls(fn)
            linear = linear_time(calls, fn is train_step, repeat)
        speedup = times[False] / times[True] if correct else None
        rows.append(Row(name, times[False], times[True], speedup, error, correct, detail, linear))
    model.zero_grad(set_to_none=True)
    return rows


def _model(name: str, hidden: int, layers: int, state: int | None, vocab: int,
           quick: bool) -> Any:  # fmt: skip
    """A randomly initialized model (transformers' own annotations are partial)."""
    import transformers

    if name == "mamba":
        config = transformers.MambaConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
            state_size=state or 16,
        )  # fmt: skip
        return transformers.MambaForCausalLM(config)
    if name == "mamba2":
        headdim = 16 if quick else 64
        config2 = transformers.Mamba2Config(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
            state_size=state or (16 if quick else 64), expand=2, head_dim=headdim,
            num_heads=2 * hidden // headdim, n_groups=1, chunk_size=16 if quick else 128,
        )  # fmt: skip
        return transformers.Mamba2ForCausalLM(config2)
    # The hybrids: every fourth layer (and the last) full attention, the others linear.
    kinds = ["full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention"
             for i in range(layers)]  # fmt: skip
    head = 16 if quick else 128
    if name == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config3 = Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
            num_hidden_layers=layers, layer_types=kinds,
            num_attention_heads=4 if quick else 8, num_key_value_heads=2,
            head_dim=2 * head, linear_key_head_dim=head, linear_value_head_dim=head,
            linear_num_key_heads=2 if quick else 4, linear_num_value_heads=4 if quick else 8,
        )  # fmt: skip
        return Qwen3_5ForCausalLM(config3)
    if name == "kimi_linear":
        from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM

        heads = 4 if quick else 8
        config4 = KimiLinearConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
            num_hidden_layers=layers, layer_types=kinds, mlp_layer_types=["dense"] * layers,
            linear_num_heads=heads, linear_head_dim=head,
            num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=4 * head,
            q_lora_rank=None, qk_nope_head_dim=head, qk_rope_head_dim=head // 2,
            v_head_dim=head, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        return KimiLinearForCausalLM(config4)
    return _other_model(name, hidden, layers, vocab, quick, kinds, head)


def _other_model(name: str, hidden: int, layers: int, vocab: int, quick: bool,
                 kinds: list[str], head: int) -> Any:  # fmt: skip
    """The families patched through one function of their layer, and xLSTM, which the
    patch leaves alone (for tools/matmul_floor.py); their sizes are in the module's
    docstring. ``kinds``: the hybrids' layer pattern, "linear_attention" for the
    recurrent layers."""
    import transformers

    heads = 4 if quick else 8
    recurrent = [kind == "linear_attention" for kind in kinds]
    if name == "lfm2":
        lfm2 = transformers.Lfm2Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
            block_auto_adjust_ff_dim=False, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=2,
            layer_types=["conv" if r else "full_attention" for r in recurrent],
        )  # fmt: skip
        return transformers.Lfm2ForCausalLM(lfm2)
    if name == "recurrent_gemma":
        griffin = transformers.RecurrentGemmaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
            lru_width=hidden, attention_window_size=2048,
            block_types=["recurrent" if r else "attention" for r in recurrent],
        )  # fmt: skip
        model: Any = transformers.RecurrentGemmaForCausalLM(griffin)
        return model.float()  # as the tests build it (float32 buffers too)
    if name == "rwkv":
        rwkv = transformers.RwkvConfig(
            vocab_size=vocab, context_length=1024, hidden_size=hidden,
            num_hidden_layers=layers, attention_hidden_size=hidden, intermediate_size=4 * hidden,
        )  # fmt: skip
        model = transformers.RwkvForCausalLM(rwkv)
        return model.float()  # as the tests build it (float32 buffers too)
    if name == "minimax":
        minimax = transformers.MiniMaxConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
            head_dim=head, num_local_experts=2, num_experts_per_tok=1,
            block_size=16 if quick else 256, pad_token_id=0, layer_types=kinds,
        )  # fmt: skip
        model = transformers.MiniMaxForCausalLM(minimax)
        return model.float()  # as the tests build it (float32 buffers too)
    if name == "xlstm":
        xlstm = transformers.xLSTMConfig(
            vocab_size=vocab, hidden_size=hidden, embedding_dim=hidden,
            num_hidden_layers=layers, num_blocks=layers, num_heads=heads,
            chunk_size=16 if quick else 64, mode="train", pad_token_id=0,
        )  # fmt: skip
        return transformers.xLSTMForCausalLM(xlstm)
    raise ValueError(
        f"bench_transformers: expected model {', '.join(map(repr, MODEL_CLASSES))}, "
        f"but got {name!r}"
    )


MODEL_CLASSES = {
    "mamba": "MambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "recurrent_gemma": "RecurrentGemmaForCausalLM",
    "rwkv": "RwkvForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "xlstm": "xLSTMForCausalLM",
}
# The models of the families the patch covers (`parascan bench --models`).
PATCHED_MODELS = tuple(name for name in MODEL_CLASSES if name != "xlstm")


def format_rows(rows: list[Row], model_name: str = "mamba") -> str:
    """The table, under a line naming the model, the machine and the versions."""
    import transformers

    machine = platform.processor() or platform.machine()
    head = (
        f"{MODEL_CLASSES.get(model_name, model_name)} on {machine}, "
        f"{torch.get_num_threads()} threads; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    names = ("workload", "unpatched s", "patched s", "speed-up", "linear s", "/ linear",
             "max error", "detail")  # fmt: skip
    cells = (
        (r.name, f"{r.unpatched_s:.3f}", f"{r.patched_s:.3f}",
         "WRONG" if r.speedup is None else f"{r.speedup:.1f}x",
         "" if r.linear_s is None else f"{r.linear_s:.3f}",
         "" if r.linear_s is None else f"{r.patched_s / r.linear_s:.2f}",
         f"{r.max_error:.1e}", r.detail)
        for r in rows
    )  # fmt: skip
    return table([head], "{:<28} {:>12} {:>10} {:>9} {:>9} {:>9}  {:>9}  {}", names, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m parascan.cli.bench_transformers",
        description="a transformers model of a family parascan's patch covers, unpatched "
        "against patched",
    )
    parser.add_argument("--model", choices=sorted(PATCHED_MODELS), default="mamba")
    parser.add_argument("--quick", action="store_true", help="a small model (seconds)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (min)")
    parser.add_argument(
        "--train-repeat", type=int, default=1, help="runs of the training step (min)"
    )
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(
        quick=args.quick, repeat=args.repeat, train_repeat=args.train_repeat,
        tokens=args.tokens, new_tokens=args.new_tokens, model_name=args.model,
        progress=lambda line: print(line, flush=True),
    )  # fmt: skip
    print(format_rows(rows, args.model))
    return 0 if all(r.correct for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
