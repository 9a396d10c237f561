"""Which int4 quantizer keeps the real SmolLM2-135M closest to its float self, judged on more than one text.

``bench_quantize.py`` measures whole exports on export/fidelity.py's paragraph (227 tokens), where one token is 0.44
points of top-1 agreement. This bench asks a narrower question with more evidence: with the weights quantized by
each method and dequantized back (float activations, i.e. accuracy level 1), how far does the PyTorch Thinker move
from the float one, on that paragraph and on a second, longer text written for this file (SECOND_TEXT)? Three
measures per text: top-1 agreement, the perplexity change, and the mean KL divergence of the next-token
distributions (the smoothest of the three: it counts every probability, not only the argmax).

Methods, each block 32 along the input axis as MatMulNBits stores them:
  rtn        onnxruntime's default quantizer, symmetric (the builder's CPU int4 and ours)
  rtn-asym   the same with a uint8 zero point per block
  k-quant    onnxruntime's k-quant (llama.cpp's weighted least-squares search of scale and minimum, integer zero
             points; ``onnxruntime.quantization.neural_compressor.weight_only``)
  hqq        onnxruntime's HQQ (float zero points: no fast CPU kernel)
  rtn-search the symmetric layout (the builder's bytes, the fast kernel) with each block's scale chosen by a
             least-squares search instead of the block's largest magnitude (``least_squares_symmetric``): the one
             calibration-free improvement that keeps that layout, which onnxruntime does not ship
Configurations pair a body method with a head (the tied embedding quantized alike), as `thinker export` would; the
head may also be "rtn mixed", the int4 default's: its first rows at int8 (export/quantize.py).

    python bench/bench_quant_methods.py          # about 15 minutes on 2 cores

Writes bench/results/quant_methods.json and bench/results/README-quant-methods.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from results_io import command_line, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import models  # noqa: E402

from export.dequantize import dequantize_matmul_nbits  # noqa: E402
from export.fidelity import FIDELITY_TEXT, mean_kl, text_fidelity  # noqa: E402
from export.names import DEFAULT_HEAD_INT8_ROWS  # noqa: E402
from export.quantize import QuantizeSpec, WeightQuantizer  # noqa: E402

RESULTS = Path(__file__).with_name("results")
# Original prose written for this benchmark (no licence attaches to it), longer than the fidelity paragraph.
SECOND_TEXT = (
    "Every town on the river kept its own ferry until the bridge was finished, and the ferrymen knew the water "
    "better than anyone. In spring the current ran fast and brown with snowmelt from the hills, and a careless "
    "crossing could carry a boat half a mile downstream before it reached the far bank. In late summer the river "
    "fell so low that sandbars rose in the middle of the channel, and the ferry had to follow a crooked path "
    "between them, marked by willow poles that the ferrymen moved every week. Farmers crossed with their carts on "
    "market days, children crossed to reach the school on the eastern side, and once a year a travelling circus "
    "paid to take its wagons over one at a time, which took the whole of a Sunday. The fare was two coins for a "
    "person and five for a horse, and the ferryman kept a ledger in which he wrote every crossing, the weather and "
    "the height of the water against a painted post on the landing. Those ledgers survive in the town library, "
    "more than forty volumes of them, and they are the best record anyone has of how the river changed over a "
    "century. They show floods in years that nobody else remembered, droughts that emptied the wells, and a winter "
    "when the river froze so hard that people walked across it for six weeks and the ferry sat idle on the bank. "
    "When the bridge opened, the last ferryman sold his boat to a fisherman and took a job collecting tolls at the "
    "bridge itself, which he did for another twenty years. He said that the work was easier but duller, because "
    "the bridge never needed to be read. A stone bridge does not care whether the water is high or low, whether "
    "the wind comes from the north or the west, or whether the passenger is in a hurry. The ferry had cared about "
    "all of these things, and so had he. Today a small museum stands where the landing used to be. It holds one "
    "of the old boats, restored with new planks where the old ones had rotted, a set of the willow poles, and the "
    "painted post with its marks, the highest of them at the level of a grown man's shoulder. School classes visit "
    "it in the autumn, and the guide, who is the ferryman's granddaughter, ends every tour the same way: she asks "
    "the children to guess how long a crossing took, and then tells them that the answer depended on the river, "
    "which is the only answer her grandfather ever gave."
)
TEXTS = {"paragraph": FIDELITY_TEXT, "second": SECOND_TEXT}
BLOCK = 32


class Sink:
    """Collects the tensors WeightQuantizer.quantize writes."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def weight(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = array


def onnxruntime_quantizer(bits: int, algo: str, block: int = BLOCK) -> Callable[[torch.Tensor], torch.Tensor]:
    """(in, out) weight -> the (in, out) weight MatMulNBits computes with after ``thinker export``'s quantizer."""
    quantizer = WeightQuantizer(QuantizeSpec(bits=bits, block_size=block, algo=algo), torch.float32)

    def apply(weight: torch.Tensor) -> torch.Tensor:
        sink = Sink()
        projection = quantizer.quantize(sink, "w.weight", weight)
        tensors = [sink.arrays[name] if name else None for name in projection.inputs[:3]]
        return torch.from_numpy(dequantize_matmul_nbits(projection.attributes, *tensors).astype(np.float32))

    return apply


def k_quant(weight: torch.Tensor) -> torch.Tensor:
    """onnxruntime's k-quant, int4, as its rtn_quantize applies it (weight transposed: blocks along the input)."""
    from onnxruntime.quantization.neural_compressor.weight_only import quant_tensor_k_quant_cpu

    q, scale, zero = quant_tensor_k_quant_cpu(weight.T.contiguous().numpy(), 4, BLOCK)
    scale = scale.astype(np.float32)  # rtn_quantize stores the scales in the weight's dtype
    dequantized = (q.astype(np.float32) - zero.astype(np.float32)) * scale
    return torch.from_numpy(dequantized.reshape(weight.shape[1], weight.shape[0]).T.copy())


def least_squares_symmetric(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 (q in [-8, 7], no zero point: MatMulNBits' fast layout) with each block's scale searched.

    Written here because onnxruntime's quantizers have no such search: its RTN maps each block's largest magnitude
    to -8, k-quant and HQQ fit zero points. For every block of 32 along the input axis: try clipping ratios of the
    block's signed extreme, round with each, refit the scale by least squares to the rounded values
    (s = <x, q> / <q, q>), round again, and keep the scale with the smallest squared error (llama.cpp's
    ``make_qx_quants`` search, unweighted: no calibration data)."""
    in_features, out_features = weight.shape
    blocks = weight.double().reshape(in_features // BLOCK, BLOCK, out_features).permute(2, 0, 1)  # (N, K/32, 32)
    extreme = torch.gather(blocks, -1, blocks.abs().argmax(-1, keepdim=True))  # the signed largest magnitude
    best_error, best_scale = torch.full_like(extreme, float("inf")), torch.ones_like(extreme)
    # The extreme maps to -8 (RTN's choice) or +7, or a little inside either: clipping trades it for the rest.
    for target in [-8 + 0.125 * k for k in range(25)] + [7 - 0.125 * k for k in range(17)]:
        scale = torch.where(extreme == 0, torch.ones_like(extreme), extreme / target)
        for _ in range(2):
            q = torch.clamp(torch.round(blocks / scale), -8, 7)
            energy = (q * q).sum(-1, keepdim=True)
            scale = torch.where(energy > 0, (blocks * q).sum(-1, keepdim=True) / energy.clamp_min(1e-30), scale)
        q = torch.clamp(torch.round(blocks / scale), -8, 7)
        error = ((blocks - scale * q) ** 2).sum(-1, keepdim=True)
        better = error < best_error
        best_error, best_scale = torch.where(better, error, best_error), torch.where(better, scale, best_scale)
    scale = best_scale.float()  # stored as MatMulNBits stores it, in the graph's float32
    dequantized = scale * torch.clamp(torch.round(blocks.float() / scale), -8, 7)
    return dequantized.permute(1, 2, 0).reshape(in_features, out_features)


def mixed_head(
    rows: int, first: tuple[int, int] = (8, BLOCK), rest: tuple[int, int] = (4, BLOCK)
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``thinker export``'s int4 default head with ``rows`` int8 rows: its first ``rows`` rows (output columns of the
    (in, out) weight) at int8, the rest at int4, both RTN in blocks of 32; ``first`` / ``rest`` give other (bits,
    block) to either part (the layouts tried for fewer bytes)."""
    head, tail = onnxruntime_quantizer(first[0], "rtn", first[1]), onnxruntime_quantizer(rest[0], "rtn", rest[1])

    def apply(weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([head(weight[:, :rows].contiguous()), tail(weight[:, rows:].contiguous())], dim=1)

    return apply


# The mixed head's int8 rows: the default, and half and twice it (how much the choice matters).
MIXED_ROWS = (DEFAULT_HEAD_INT8_ROWS // 2, DEFAULT_HEAD_INT8_ROWS, 2 * DEFAULT_HEAD_INT8_ROWS)


METHODS: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "rtn": lambda: onnxruntime_quantizer(4, "rtn"),
    "rtn-asym": lambda: onnxruntime_quantizer(4, "rtn-asym"),
    "k-quant": lambda: k_quant,
    "hqq": lambda: onnxruntime_quantizer(4, "hqq"),
    "rtn-search": lambda: least_squares_symmetric,
    "rtn int8": lambda: onnxruntime_quantizer(8, "rtn"),
    "rtn mixed": lambda: mixed_head(DEFAULT_HEAD_INT8_ROWS),
    **{
        f"rtn mixed {rows}": (lambda rows=rows: mixed_head(rows))
        for rows in MIXED_ROWS
        if rows != DEFAULT_HEAD_INT8_ROWS
    },
    # Fewer bytes for the mixed head: its int8 rows in blocks of 128 (3 % of their bytes are scales, not 11 %), its
    # first rows at int4 in blocks of 16 instead of int8, its other rows in blocks of 64.
    "rtn mixed, int8 rows b128": lambda: mixed_head(DEFAULT_HEAD_INT8_ROWS, first=(8, 128)),
    "rtn mixed, first rows int4 b16": lambda: mixed_head(DEFAULT_HEAD_INT8_ROWS, first=(4, 16)),
    "rtn mixed, other rows b64": lambda: mixed_head(DEFAULT_HEAD_INT8_ROWS, rest=(4, 64)),
}
# (body, head): the builder's layout, the int8 head, our default (the mixed head), each other body method under the
# int8 head, and our
# body under each int4 head method with integer zero points (the builder's bytes, give or take the zero points);
# last, the searched symmetric scales in the builder's layout and under our int8 head.
CONFIGS = [
    ("rtn", "rtn"),
    ("rtn", "rtn int8"),
    ("rtn", "rtn mixed"),
    ("rtn-asym", "rtn int8"),
    ("k-quant", "rtn int8"),
    ("k-quant", "k-quant"),
    ("hqq", "rtn int8"),
    ("rtn", "rtn-asym"),
    ("rtn", "k-quant"),
    ("rtn-search", "rtn-search"),
    ("rtn-search", "rtn int8"),
    *(("rtn", f"rtn mixed {rows}") for rows in MIXED_ROWS if rows != DEFAULT_HEAD_INT8_ROWS),
    ("rtn", "rtn mixed, int8 rows b128"),
    ("rtn", "rtn mixed, first rows int4 b16"),
    ("rtn", "rtn mixed, other rows b64"),
]


def text_measures(logits: torch.Tensor, reference: torch.Tensor, ids: torch.Tensor) -> dict:
    """What ``--verify`` reports as the cost (export/fidelity.py: top-1 agreement and perplexity change over the
    next-token predictions) and the mean KL(float || quantized) over them."""
    logits, reference = logits.numpy(), reference.numpy()
    figures = text_fidelity(reference, logits, ids.numpy())
    return {
        "top1": figures["top1_agreement"],
        "perplexity_change": figures["perplexity_change"],
        "mean_kl": mean_kl(reference[:-1], logits[:-1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    from transformers import AutoTokenizer

    from thinker import ThinkerForCausalLM

    folder = models.smollm2().thinker
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if not model.config.tie_word_embeddings:
        raise SystemExit("bench_quant_methods expects SmolLM2's tied head")
    texts = {name: torch.tensor(tokenizer(text)["input_ids"]) for name, text in TEXTS.items()}
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    head_name = "model.embed_tokens.weight"
    with torch.no_grad():
        reference = {name: model(ids[None]).logits[0] for name, ids in texts.items()}
    # Where the float model's next-token picks lie in the vocabulary: what the mixed head's int8 rows cover.
    picks = {
        name: {rows: round(float((logits[:-1].argmax(-1) < rows).float().mean()), 4) for rows in MIXED_ROWS}
        for name, logits in reference.items()
    }
    rows = []
    for body, head in CONFIGS:
        started = time.perf_counter()
        quantize_body, quantize_head = METHODS[body](), METHODS[head]()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                weight = original[name]
                if name == head_name:  # the tied head: (V, C) is (out, in)
                    parameter.copy_(quantize_head(weight.T.contiguous()).T)
                elif weight.ndim == 2:  # nn.Linear's (out, in)
                    parameter.copy_(quantize_body(weight.T.contiguous()).T)
            measures = {
                name: text_measures(model(ids[None]).logits[0], reference[name], ids) for name, ids in texts.items()
            }
        rows.append({"body": body, "head": head, "texts": measures, "seconds": round(time.perf_counter() - started, 1)})
        print(f"{body} / {head}: {json.dumps(measures)}", flush=True)
    result = {
        "command": command_line(),
        "model": str(folder),
        "tokens": {name: len(ids) for name, ids in texts.items()},
        "block_size": BLOCK,
        "activations": "float (accuracy level 1)",
        "float_top1_in_first_rows": picks,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    write_result((RESULTS / "quant_methods.json"), json.dumps(result, indent=2) + "\n")
    write_result((RESULTS / "README-quant-methods.md"), report(result))
    print(report(result))


def report(result: dict) -> str:
    tokens = result["tokens"]
    lines = [
        "Command: `python bench/bench_quant_methods.py`. SmolLM2-135M, weights quantized (int4 block 32 unless "
        "named) and dequantized, float activations; against the float model. "
        f"Texts: export/fidelity.py's paragraph ({tokens['paragraph']} tokens) and the bench's second text "
        f"({tokens['second']} tokens).",
        "",
        "| body | head | paragraph: top-1 | perplexity | mean KL | second text: top-1 | perplexity | mean KL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        cells = []
        for name in ("paragraph", "second"):
            m = row["texts"][name]
            cells += [f"{m['top1']:.1%}", f"{m['perplexity_change']:+.1%}", f"{m['mean_kl']:.3f}"]
        lines.append(f"| {row['body']} | {row['head']} | " + " | ".join(cells) + " |")
    picks = result.get("float_top1_in_first_rows")
    if picks:
        shares = "; ".join(
            f"{name}: " + ", ".join(f"{share:.0%} in the first {rows}" for rows, share in by_rows.items())
            for name, by_rows in picks.items()
        )
        lines += ["", f"The float model's top-1 tokens (the mixed head's int8 rows cover the first ones): {shares}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
