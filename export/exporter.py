"""``thinker export``: a Thinker folder (or any source thinker-convert reads) to an ONNX folder.

The output folder holds ``model.onnx`` + ``model.onnx.data``, ``genai_config.json``, the tokenizer and model
configs, and ``export_report.json``. It is written into a temporary sibling folder that is renamed into place only
when everything (the checker, the optional parity check) has passed, so OUTPUT is either complete or untouched.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from pkgutil import resolve_name
from typing import TYPE_CHECKING

import onnx
import torch

from converter.hub import local_checkpoint, normal_subfolder, refuse_empty_source, resolve_source
from converter.model_card import source_top
from converter.thinker_config import load_thinker_config
from thinker.configuration_thinker import ThinkerConfig
from thinker_common.dtypes import FLOAT_DTYPES, dtype_name, torch_dtype
from thinker_common.errors import ThinkerError
from thinker_common.model_card import in_hub_snapshot
from thinker_common.parity_inputs import RELATIVE_TOLERANCE
from thinker_common.progress import progress_bar
from thinker_common.side_files import (
    CONFIG_FILES,
    copy_files,
    has_vocabulary,
    read_json,
    readable_tokenizer_files,
    tokenizer_files,
)
from thinker_common.sizes import human_size
from thinker_common.source_files import present
from thinker_common.sources import SafetensorsSource
from thinker_common.staging import install, refuse_existing_output, refuse_output_over_source, work_folder

from .contrib_schemas import register_onnxruntime_schemas
from .decoder_graph import IR_VERSION, OPSET, DecoderGraph, make_model, not_exported, position_form
from .embeds_graph import embeds_positions_note, embeds_refusal, write_embeds_graphs
from .folder_check import check_thinker_folder
from .genai_config import check_search, logits_note, make_genai_config, no_eos_note
from .genai_graph import write_genai_graph
from .graph_builder import GraphBuilder, WeightFile
from .graph_walk import all_nodes
from .half_spread import HALF_PRECISIONS
from .leading_tokens import leading_special_ids, prefix_note
from .model_card import write_onnx_card
from .names import (
    DATA_FILE,
    DEFAULT_GRAPH,
    DEFAULT_LOGITS,
    DTYPE_KEY,
    EMBED_FILE,
    EMBEDS_MODEL_FILE,
    EXPORT_ID_KEY,
    GENAI_CONFIG_FILE,
    GRAPHS,
    LOGITS,
    MODEL_FILE,
    POSITIONS,
    REPORT_FILE,
    export_files,
)
from .quantize import HEAD, QuantizeSpec, WeightQuantizer, cuda_experts_note
from .quantized_size import expected_graph_bytes
from .runtime import ORT_RUN_ERRORS
from .verify import WHOLE, verify_export, verify_plan
from .weights import ThinkerWeights
from .weights_stamp import stamp_weights

if TYPE_CHECKING:
    from .quantized_verify import QualityGate


@dataclass
class GraphFiles:
    model_path: Path
    kv_in_place: bool  # the cache may be one buffer bound as past and present (genai_config's share_buffer)
    nodes: int
    nodes_by_op: dict[str, int]
    parameters: int
    data_bytes: int


def routed_experts(config: ThinkerConfig, nodes_by_op: dict[str, int], guard: dict | None = None) -> dict[str, str]:
    """For a quantized MoE export, what its routed experts became (read off the graph's operators): onnxruntime's
    QMoE, the accuracy guard's float MoE fallbacks of some or all of them (``guard``: its report), or the plain
    graph's int8-held experts dequantized as each step gathers them (its expert Loop, or a decode step's picked
    experts at once; also Qwen2-MoE's unnormalised routing in the fused graph)."""
    if not config.num_experts:
        return {}
    fallbacks = len((guard or {}).get("experts_to_float_moe", []))
    if fallbacks:
        kept = f"QMoE in {nodes_by_op['QMoE']} layers, " if nodes_by_op.get("QMoE") else ""
        return {"routed_experts": f"{kept}float MoE in {fallbacks} (the accuracy guard's fallback)"}
    if nodes_by_op.get("QMoE"):
        return {"routed_experts": "QMoE"}
    if nodes_by_op.get("DequantizeLinear"):
        return {"routed_experts": "DequantizeLinear of the gathered experts"}
    return {"routed_experts": FLOAT_EXPERTS}


FLOAT_EXPERTS = "float (too narrow: widths not whole blocks, or fewer than 16 outputs)"


def counted(files: GraphFiles) -> GraphFiles:
    """``files`` with the graph's figures read again from the files: the accuracy guard rewrites them (nodes at
    another level, float fallbacks beside or instead of MatMulNBits and QMoE, a larger weights file)."""
    graph = onnx.load(str(files.model_path), load_external_data=False).graph
    ops = count_ops(graph)
    # the tensors' own bytes, as WeightFile counts them (the file also holds each tensor's alignment padding)
    lengths = (int(entry.value) for t in graph.initializer for entry in t.external_data if entry.key == "length")
    return replace(files, nodes=sum(ops.values()), nodes_by_op=dict(sorted(ops.items())), data_bytes=sum(lengths))


def genai_note(config: ThinkerConfig) -> str | None:
    """Why a Qwen3.8 export has no genai_config.json."""
    if not config.qwen4_exp_features:
        return None
    return (
        f"no genai_config.json: onnxruntime-genai has no model type that carries the state of Qwen3.8's "
        f"{', '.join(config.qwen4_exp_features)}; run model.onnx with `thinker generate` or export.runtime.OnnxDecoder"
    )


def head_quantized(model_path: Path) -> bool:
    """Whether the written graph computes the head from quantized weights (MatMulNBits, or the guard's float
    fallback of them), read from its nodes."""
    from .dequantize import quantized_weight_readers

    return HEAD in quantized_weight_readers(model_path)


def refuse_nothing_quantized(
    quantize: QuantizeSpec, nodes_by_op: dict[str, int], quantizer: WeightQuantizer, source: str | Path
) -> None:
    """``--quantize`` that quantized no weight (a --block-size wider than every projection's input) is refused: the
    export would be the float graph under a quantized label, and its accuracy guard and verify would run for
    nothing."""
    from .dequantize import QUANTIZED_OPS

    if any(nodes_by_op.get(op) for op in (*QUANTIZED_OPS, "DequantizeLinear")):  # the plain graph's int8 experts
        return
    why = quantizer.narrow_note() or "no projection of it has a quantizable shape"
    raise ThinkerError(f"--quantize int{quantize.bits}: no weight of {source} would be quantized: {why}")


def float_experts_note(
    config: ThinkerConfig, quantize: QuantizeSpec | None, nodes_by_op: dict[str, int], guard: dict | None = None
) -> str | None:
    """A quantized MoE export whose routed experts stayed float (most of an MoE's weights) for their widths says so
    on the console, not only in export_report.json. Experts the accuracy guard moved to float (``guard``: its
    report) are its own line's to say: their widths fit."""
    if quantize is None or routed_experts(config, nodes_by_op, guard).get("routed_experts") != FLOAT_EXPERTS:
        return None
    advice = WeightQuantizer(quantize, torch.float32).experts_advice(config.hidden_size, config.moe_intermediate_size)
    return (
        f"the routed experts stay float: their widths (hidden_size={config.hidden_size}, moe_intermediate_size="
        f"{config.moe_intermediate_size}) do not fit --block-size {quantize.block_size}; {advice}"
    )


def export_model(
    source: str | Path,
    output: str | Path,
    dtype: str | torch.dtype = "float32",
    verify: bool = True,
    force: bool = False,
    threads: int | None = None,
    graph: str | None = None,
    quantize: QuantizeSpec | None = None,
    progress: bool = True,
    quality: QualityGate | None = None,
    accuracy_guard: float | None = None,
    positions: str | None = None,
    logits: str | None = None,
    inputs_embeds: bool = False,
    gguf_file: str | None = None,
    revision: str | None = None,
    subfolder: str | None = None,
) -> dict:
    """Exports ``source`` to the folder ``output`` and returns the export report (also written there).

    ``graph``: "plain" or "fused" (see GRAPHS), None for ``DEFAULT_GRAPH`` (fused); ``quantize``:
    weight-only int4/int8 of the projections, whose cost against the float model ``--verify`` holds to ``quality``
    (default: ``QualityGate.default``); ``progress``: bars on stderr for writing (or quantizing) the weights and for
    verifying, where it is a terminal; ``accuracy_guard``: with ``quantize`` at accuracy level 4, the least top-1
    agreement with the same graph at level 1 on a fixed paragraph, below which the most sensitive layers fall back
    to level 1 (export/accuracy_guard.py; None: no guard); ``positions``: "multimodal" or "text" (see POSITIONS),
    None for the model's own form (multimodal with multimodal RoPE); ``logits``: "all" or "last" (see LOGITS), None
    for ``DEFAULT_LOGITS``; ``inputs_embeds``: also write ``model.embeds.onnx`` and ``embed.onnx``
    (export/embeds_graph.py); ``gguf_file``: the GGUF file of a source (a Hub repo or a folder) that holds several,
    converted on the way; ``revision``: the branch, tag or commit of a Hub repo id ``source`` (default main);
    ``subfolder``: the checkpoint's folder inside ``source`` (a Hub repo or a local folder), as transformers'
    ``from_pretrained(..., subfolder=)``."""
    refuse_empty_source(source)
    output = Path(output)
    if isinstance(dtype, torch.dtype):  # as transformers' dtype= takes it
        dtype = dtype_name(dtype)
    if dtype not in FLOAT_DTYPES:
        raise ThinkerError(f"--dtype {dtype}: expected one of {', '.join(FLOAT_DTYPES)}")
    if quantize is not None and not isinstance(quantize, QuantizeSpec):
        raise ThinkerError(
            f"quantize={quantize!r}: pass a QuantizeSpec (export.quantize), e.g. QuantizeSpec(bits=4), as the CLI's "
            "--quantize builds one"
        )
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ThinkerError(f"threads={threads!r}: a whole number of threads above 0, or None for every core")
    if graph is not None and graph not in GRAPHS:
        raise ThinkerError(f"--graph {graph}: expected one of {', '.join(GRAPHS)}")
    if positions is not None and positions not in POSITIONS:
        raise ThinkerError(f"--positions {positions}: expected one of {', '.join(POSITIONS)}")
    if logits is not None and logits not in LOGITS:
        raise ThinkerError(f"--logits {logits}: expected one of {', '.join(LOGITS)}")
    graph = graph or DEFAULT_GRAPH
    logits = logits or DEFAULT_LOGITS
    graph_dtype = torch_dtype(dtype)
    quantizer = WeightQuantizer(quantize, graph_dtype) if quantize else None
    subfolder = normal_subfolder(subfolder) or None  # as the report and the card name it
    # checked before a download; a GGUF once it is picked
    refuse_existing_output(output, force, source=local_checkpoint(source, subfolder) if gguf_file is None else None)
    location = local_source(source, gguf_file, revision, subfolder)
    refuse_output_over_source(output, location)
    top = source_top(str(source), location)  # whose card and license cover a part of SOURCE (--subfolder)
    started = time.perf_counter()
    if not quantize:
        needed = weights_size(location, graph_dtype)
    elif quantize.awq:  # the scaled model staged in float32, and the graph written beside it: every weight there
        # takes at least its bits (helper-242: a disk-full message counting the copy alone read "needs more than the
        # 513.1 MiB of its weights, 663.5 MiB free")
        staged = weights_size(location, torch.float32)
        needed = None if staged is None else staged + staged * quantize.bits // 32
    else:  # smaller than the float weights, by how much varies
        needed = None
    with work_folder(output, needed) as staging, thinker_folder(location, staging, top, verify) as model_dir:
        check_paths(model_dir)
        config = load_config(model_dir)
        check_thinker_folder(model_dir, config, graph_dtype, verify)  # the structure, before a byte is written
        readable_tokenizer_files(model_dir)  # and the tokenizer copied beside the graph
        if verify and quantize and quality is not None and quality.required:
            refuse_unmeasurable_cost(model_dir, config)  # before the export, not after it (helper-242)
        if inputs_embeds and embeds_refusal(config):
            raise ThinkerError(embeds_refusal(config))
        check_search(model_dir / "generation_config.json", config)  # its sampling keys and max_length
        whole_head_note = quantize.whole_head_note(config.vocab_size) if quantize else None
        if quantize and quantize.float_embedding and not config.tie_word_embeddings:
            raise ThinkerError(
                f"--embedding float: {source}'s embedding is not tied to its head (tie_word_embeddings false), "
                "so it stays float anyway; drop --embedding"
            )
        if quantize:  # known only now: whether a mixed head's int8 rows are the whole vocabulary (the quantizer
            quantize = quantize.for_vocab(config.vocab_size)  # writes such a head whole either way: head_rows)
        graph_class = resolve_name(GRAPHS[graph])
        # decided once: the memory plan below counts the graph the scales will give, and they then run or not
        beyond_memory = scales_beyond_memory(model_dir) if quantize and quantize.awq else None
        if verify and quantize:  # the memory, the graph's two sessions counted at the layout's size
            standard_experts = graph_class.standard_experts(config)
            layout = planned_layout(config, quantize, beyond_memory)
            expected = expected_graph_bytes(model_dir, config, graph_dtype, layout, standard_experts)
            plan = verify_plan(model_dir, graph_dtype, quantized=True, graph_bytes=expected)
        elif verify:
            plan = verify_plan(model_dir, graph_dtype)
        else:
            plan = None
        positions = position_form(config, positions)
        final = staging / "onnx"
        # The weights the graph holds: the folder's, or the same model scaled for rounding (export/awq.py), which
        # the checks then hold the graph to; the tokenizer, card and report still come from the folder itself.
        weights_dir, awq = model_dir, None
        if quantize and quantize.awq:
            weights_dir, awq, coarse = scaled_for_rounding(
                model_dir, staging / "awq", quantize, graph_dtype, progress, beyond_memory
            )
            if "skipped" in awq:  # the report, the card and any refusal then name plain rounding, in blocks of 32
                quantize = replace(quantize, awq=False, scaled_block_size=None)
            quantize = quantize.covering(coarse)  # the weights rounded in the scales' own blocks
            quantizer = WeightQuantizer(quantize, graph_dtype)
        files = build_onnx(
            weights_dir, config, final, graph_dtype, graph_class, quantizer, progress, positions, logits, str(source)
        )
        if quantize:
            refuse_nothing_quantized(quantize, files.nodes_by_op, quantizer, source)
            head_is_quantized = head_quantized(files.model_path)
            if not head_is_quantized:  # the head stayed float (narrower than a block): it has no int8 rows either
                whole_head_note = None
        guard = None
        if quantize and quantize.accuracy_level == 4 and accuracy_guard is not None:
            from .accuracy_guard import guard_accuracy_level

            guard = guard_accuracy_level(
                weights_dir,
                files.model_path,
                config.vocab_size,
                config.max_position_embeddings,
                accuracy_guard,
                threads,
                progress,
            )
            files = counted(files)
        tokenizer = copy_side_files(model_dir, final)
        if inputs_embeds:  # after the guard, which may rewrite model.onnx and its weights
            write_embeds_graphs(files.model_path, graph_dtype, config.hidden_size)
        generation_config = read_json(model_dir / "generation_config.json")
        prefix: list[int] = []  # what onnxruntime-genai's tokenizer leaves out of a prompt (export/leading_tokens.py)
        if not config.qwen4_exp_features:  # Qwen3.8's states are more than onnxruntime-genai carries: genai_note
            # after the guard, which may rewrite model.onnx
            genai_graph = write_genai_graph(files.model_path, graph_dtype)
            genai = make_genai_config(
                config,
                generation_config,
                threads,
                files.kv_in_place,
                "text" if genai_graph and genai_graph.positions else positions,  # a genai graph's positions: (B, T)
                graph=genai_graph.path.name if genai_graph else MODEL_FILE,
                graph_positions=genai_graph.positions if genai_graph else True,
            )
            (final / GENAI_CONFIG_FILE).write_text(json.dumps(genai, indent=2) + "\n")
            prefix = leading_special_ids(model_dir) if has_vocabulary(tokenizer) else []  # the files copied over
        report = {
            "source": str(source),
            "revision": revision,
            "subfolder": subfolder,
            "gguf_file": gguf_file,
            "converted": model_dir != location,  # True: SOURCE went through thinker-convert first
            "commit": in_hub_snapshot(location)[0],  # a Hub repo's: the snapshot converted (None: a local source)
            "dtype": dtype,
            "graph": graph,
            "positions": positions,
            "logits": logits,
            "inputs_embeds": {"model": EMBEDS_MODEL_FILE, "embed": EMBED_FILE} if inputs_embeds else None,
            "quantize": quantize.describe(head_is_quantized)
            | routed_experts(config, files.nodes_by_op, guard)
            | ({"activation_scales": awq} if awq else {})
            if quantize
            else None,
            "accuracy_guard": guard,
            "opset": OPSET,
            "ir_version": IR_VERSION,
            "nodes": files.nodes,
            "nodes_by_op": files.nodes_by_op,
            "parameters": files.parameters,
            "sizes": {},  # once every file is written, below
            "export_seconds": round(time.perf_counter() - started, 3),
            "verify": None,
            "versions": versions(),
            # the ids transformers' tokenizer puts in front of a prompt, which onnxruntime-genai's leaves out
            "genai_prompt_prefix": prefix,
            "notes": [
                note
                for note in (
                    no_eos_note(config, generation_config),
                    prefix_note(prefix),
                    None if has_vocabulary(tokenizer) else NO_TOKENIZER_NOTE,
                    genai_note(config),
                    logits_note(logits),
                    embeds_positions_note(config, positions) if inputs_embeds else None,
                    cuda_experts_note(config, dtype, quantize, files.nodes_by_op),
                    quantizer.narrow_note() if quantizer else None,
                    quantizer.few_outputs_head_note(config, head_is_quantized) if quantizer else None,
                    whole_head_note,
                    float_experts_note(config, quantize, files.nodes_by_op, guard),
                    awq.get("skipped") if awq else None,
                )
                if note
            ],
        }
        described = f", {quantize.label(head_is_quantized)}" if quantize else ""  # what a failure names
        try:
            if verify and quantize:
                from .quantized_verify import verify_quantized_export

                plan = verify_plan(model_dir, graph_dtype, quantized=True, graph_bytes=files.data_bytes)
                report["verify"] = verify_quantized_export(
                    weights_dir,
                    files.model_path,
                    graph_dtype,
                    quantize.bits,
                    quality,
                    threads,
                    progress,
                    plan or WHOLE,
                    asked=quantize,
                )
            elif verify:
                report["verify"] = verify_export(
                    model_dir, files.model_path, graph_dtype, threads=threads, progress=progress, plan=plan or WHOLE
                )
        except ORT_RUN_ERRORS as err:  # the graph loaded, and onnxruntime failed running it
            reason = " ".join(str(err).split())[:400]
            raise ThinkerError(
                f"onnxruntime fails running the exported graph in its check ({type(err).__name__}: {reason}) "
                f"({dtype}, {graph} graph{described}); the export was not written: {run_failure_advice(reason)}"
            ) from None
        if verify and report["verify"].get("passed") is False:
            failure = report["verify"]["failure"]
            what = "the quantized export fails its check" if quantize else "onnxruntime disagrees with PyTorch"
            raise ThinkerError(
                f"{what}: {failure} ({dtype}, {graph} graph{described}); the export was not written"
                f"{half_failure_advice(graph_dtype, failure)}"
            )
        write_onnx_card(final, model_dir, report, output.name, top if model_dir == location else None)
        report["sizes"] = {p.name: p.stat().st_size for p in sorted(final.iterdir())}  # the card's too
        (final / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        install(final, output.absolute(), force)  # atomic: OUTPUT is the old folder or the new one, never partial
    return report


def scaled_for_rounding(
    model_dir: Path,
    output: Path,
    quantize: QuantizeSpec,
    graph_dtype: torch.dtype,
    progress: bool,
    beyond_memory: str | None,
) -> tuple[Path, dict, frozenset[str]]:
    """``model_dir``'s Thinker scaled for rounding (export/awq.py) in ``output``, its figures for the report, and
    the weights scaled for ``quantize.scaled_block_size``; ``model_dir`` itself and the reason in ``skipped`` where
    it cannot be: the largest part of the model the scales hold at once (a decoder layer, the embeddings or the
    head, in float32) does not fit in memory (``beyond_memory``, ``scales_beyond_memory``'s note, decided once by
    the caller for the memory plan too), or no projection of the model reads an input whose scale folds away."""
    from .awq import scale_for_rounding

    if beyond_memory:  # scales_beyond_memory's note
        return model_dir, {"skipped": beyond_memory}, frozenset()
    scaled = scale_for_rounding(
        model_dir,
        output,
        quantize.bits,
        quantize.block_size,
        progress,
        graph_dtype=graph_dtype,
        coarse_block_size=quantize.scaled_block_size,
    )
    if scaled is None:
        skipped = (
            "activation-aware scales (--awq) skipped: no projection of this model reads an input whose scale folds "
            "away (export/awq.py: Gated DeltaNet, routed experts, indexers, hyper-connections and per-layer "
            "embeddings keep plain rounding); the weights are plain round-to-nearest"
        )
        return model_dir, {"skipped": skipped}, frozenset()
    return scaled.folder, scaled.report, scaled.coarse


def scales_beyond_memory(model_dir: Path) -> str | None:
    """Why the activation-aware scales are skipped for memory (the report's note), or None where they fit."""
    from converter.parity import memory_budget

    from .awq import MEMORY_FACTOR, held_bytes

    needed = held_bytes(model_dir)
    budget = memory_budget(share=1.0)
    if needed * MEMORY_FACTOR <= budget:
        return None
    return (
        f"activation-aware scales (--awq) skipped: they read the model a part at a time, and its largest part (a "
        f"decoder layer, the embeddings or the head) takes {human_size(needed)} in float32, with "
        f"{human_size(budget)} of memory available; the weights are plain round-to-nearest (--no-awq asks for "
        "that without this note)"
    )


def planned_layout(config: ThinkerConfig, quantize: QuantizeSpec, beyond_memory: str | None) -> QuantizeSpec:
    """``quantize`` as the graph will store it, known before the scales run: under their coarser block, the
    weights they will cover (export/awq.py ``coarse_weights``, from the model's structure), so that the memory plan
    made before a byte is written counts those at the coarser block; none where the scales are skipped for memory
    (``beyond_memory``, ``scales_beyond_memory``'s note). Counted at ``block_size``, they overstated the graph by up
    to a ninth and refused a streamed check that fits (bench/bench_verify_memory.py's int4 run)."""
    if not quantize.awq or not quantize.scaled_block_size or beyond_memory:
        return quantize
    from .awq import coarse_weights

    return quantize.covering(coarse_weights(config, quantize.scaled_block_size))


def half_failure_advice(dtype: torch.dtype, failure: str) -> str:
    """What a user can do about a half-precision graph whose logits part from the model's beyond the tolerance
    (``max |Δlogit|`` in the failure, which does not advise already): the float32 export's far tighter check tells a
    graph bug from rounding; --no-verify writes this one. Not for the other failures (a quantization cost a float32
    export pays too, an overflow, a router), where that advice would be wrong."""
    if dtype not in HALF_PRECISIONS or "max |Δlogit|" not in failure or "--no-verify" in failure:
        return ""
    tighter = RELATIVE_TOLERANCE[dtype] / RELATIVE_TOLERANCE[torch.float32]
    return (
        f": a float32 export of the same model is checked {tighter:.0f}x tighter and tells a graph bug from rounding; "
        "--no-verify writes this one unchecked"
    )


def run_failure_advice(reason: str) -> str:
    """What to do about onnxruntime failing to run a graph that loaded: out of memory (its allocator's words on the
    CPU and CUDA), the machine's to mend; else a kernel refused what the graph gave it, the exporter's bug."""
    if any(words in reason.lower() for words in ("failed to allocate", "bad_alloc", "out of memory")):
        return (
            "onnxruntime ran out of memory; free some, set THINKER_VERIFY_MEMORY to plan the check for less, or pass "
            "--no-verify"
        )
    return "an exporter bug, please report it with the model's config.json"


def build_onnx(
    model_dir: Path,
    config: ThinkerConfig,
    out_dir: Path,
    dtype: torch.dtype,
    graph_class: type[DecoderGraph] = DecoderGraph,
    quantizer: WeightQuantizer | None = None,
    progress: bool = False,
    positions: str | None = None,
    logits: str = "all",
    source: str | None = None,
) -> GraphFiles:
    """Writes ``model.onnx`` and ``model.onnx.data`` into ``out_dir`` and checks them; ``progress``: a bar over
    the weights read (quantizing, when ``quantizer``, is most of the time); ``positions``: the form of position_ids
    (``position_form``); ``logits``: "all" or "last" (LOGITS); ``source``: the model as the user named it, for the
    metadata (``model_dir`` itself by default: a source converted on the way lies in a staging folder that goes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = ThinkerWeights(model_dir, dtype, config.tie_word_embeddings, not_exported(config))
    data = WeightFile(out_dir / DATA_FILE)
    contrib_ops = graph_class.contrib_ops or quantizer is not None
    desc = "quantizing" if quantizer is not None else "exporting"
    weights.progress = progress_bar(weights.exported_bytes(), desc, enabled=progress)
    try:
        graph_object = graph_class(config, weights, GraphBuilder(data), dtype, quantizer, positions, logits)
        graph = graph_object.build()
        parameters = weights.parameters_read()
        unused = weights.unused()
        if unused:
            raise ThinkerError(
                f"{model_dir}: tensors the ONNX graph does not use: {', '.join(unused[:8])}"
                + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
                + "; the config does not describe these weights"
            )
    finally:
        weights.progress.close()
        data.close()
        weights.close()
    metadata = {
        DTYPE_KEY: str(dtype).removeprefix("torch."),
        "thinker.source": source or str(model_dir),
        EXPORT_ID_KEY: uuid.uuid4().hex,
    }
    model = make_model(graph, metadata, contrib_ops=contrib_ops)
    stamp_weights(model, out_dir / DATA_FILE)  # restamped by the accuracy guard's fallback if it rewrites them
    model_path = out_dir / MODEL_FILE
    onnx.save_model(model, model_path)  # the proto alone: the weights are in DATA_FILE already
    if contrib_ops:
        register_onnxruntime_schemas()
    try:
        # On the path, so that the checker follows the external data and has no 2 GB limit.
        onnx.checker.check_model(str(model_path))
    except onnx.checker.ValidationError as err:
        raise RuntimeError(f"the exported graph is invalid (a bug in the exporter): {err}") from err
    ops = count_ops(model.graph)
    return GraphFiles(
        model_path=model_path,
        kv_in_place=graph_object.kv_in_place,
        nodes=sum(ops.values()),
        nodes_by_op=dict(sorted(ops.items())),
        parameters=parameters,
        data_bytes=data.bytes_written,
    )


def check_paths(model_dir: Path) -> None:
    written = export_files(model_dir)
    if MODEL_FILE in written or (written and not any(model_dir.glob("*.safetensors"))):
        raise ThinkerError(f"{model_dir} is an ONNX export already; export the Thinker folder it came from")


def local_source(
    source: str | Path, gguf_file: str | None = None, revision: str | None = None, subfolder: str | None = None
) -> Path:
    """SOURCE as a local path: the path itself, or for a Hub repo id the snapshot the converter downloads it to (at
    ``revision``; so that OUTPUT is checked against the files it is made from before any work); with ``subfolder``,
    its folder; with ``gguf_file``, that file in either."""
    path = Path(source).expanduser()
    if (path.exists() or path.is_symlink()) and gguf_file is None and revision is None and not subfolder:
        return path
    return resolve_source(str(source), revision, subfolder=subfolder, gguf_file=gguf_file)


# --- the model folder ---------------------------------------------------------------------------------------------
def load_config(model_dir: Path) -> ThinkerConfig:
    return load_thinker_config(model_dir)


def refuse_unmeasurable_cost(model_dir: Path, config) -> None:
    """Limits the user set on the quantization cost hold only where the cost is measured: the fidelity paragraph
    through the folder's own tokenizer (export/fidelity.py). Without one the verify would fail at its end, the whole
    export spent; refused here instead."""
    from .fidelity import fidelity_token_ids

    ids, why = fidelity_token_ids(model_dir, config.vocab_size, config.max_position_embeddings)
    if ids is None:
        raise ThinkerError(
            f"--min-top1 / --max-perplexity-increase limit the quantization cost, which cannot be measured here: "
            f"{why}; copy the source model's tokenizer files into the folder, or drop the limits (the default ones "
            "pass with a note)"
        )


def weights_size(source: str | Path, dtype: torch.dtype) -> int | None:
    """Bytes of a Thinker folder's weights in ``dtype``, what the export writes; None for a source converted on the
    way (the conversion checks its own size)."""
    if not is_thinker_folder(Path(source)):
        return None
    weights = SafetensorsSource(Path(source))
    try:
        return sum(math.prod(weights.shape(name)) for name in weights.names()) * dtype.itemsize
    finally:
        weights.close()


def is_thinker_folder(path: Path) -> bool:
    config = read_json(path / "config.json") if path.is_dir() else None
    return bool(config) and config.get("model_type") == "thinker"


@contextmanager
def thinker_folder(source: str | Path, staging: Path, top: Path | None = None, verify: bool = True) -> Iterator[Path]:
    """``source`` itself when it is a Thinker folder, else a Thinker folder converted from it into ``staging``
    (a Hub repo id or any checkpoint thinker-convert reads; with ``verify``, the converter checks its own parity
    when it fits: export's --no-verify skips it too, whose refusals advised a --no-verify the user had given).
    ``top``: the folder SOURCE names where ``source`` is a part of it, whose card and license cover it."""
    path = Path(source)
    if is_thinker_folder(path):
        yield path
        return
    if path.is_file() and is_thinker_folder(path.parent):  # its weights file: converting it would find a Thinker
        raise ThinkerError(f"{path}: a file of the Thinker folder {path.parent}; give the folder itself as MODEL_DIR")
    from converter.convert import convert

    from .folder_check import check_exportable

    def check_source(config: ThinkerConfig, config_path: Path) -> None:  # refused before converting, by the source's
        check_exportable(config, config_path)  # what the graphs do not build
        check_search(config_path.parent / "generation_config.json", config, "the source")  # names: a file it has

    converted = staging / "thinker"
    convert(path, converted, verify=verify, check_config=check_source, card_top=top)
    yield converted


def copy_side_files(model_dir: Path, out_dir: Path) -> list[str]:
    """Beside the graph: the model's own configs, and the tokenizer (for `thinker generate` and onnxruntime-genai),
    every file of it the Thinker folder has; the tokenizer's names, copied. config.json goes without its
    ``auto_map``: the modeling code it names is the PyTorch model's, which an ONNX folder does not carry, and a stale
    map makes transformers ask whether to run code that is not there (AutoTokenizer on the folder did)."""
    copy_files([name for name in CONFIG_FILES if present(model_dir / name, model_dir)], model_dir, out_dir)
    tokenizer = copy_files(tokenizer_files(model_dir), model_dir, out_dir)
    config_path = out_dir / "config.json"
    config = read_json(config_path) if config_path.is_file() else None
    if isinstance(config, dict) and config.pop("auto_map", None) is not None:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tokenizer


# Said on the console and in the report where the Thinker folder had no tokenizer (a weights-only checkpoint): the
# export passed without a word, and its card's text-prompt examples could not run (found by a QA run).
NO_TOKENIZER_NOTE = (
    "the Thinker folder has no tokenizer, so neither has this one: it runs on token ids (export.runtime.OnnxDecoder, "
    "onnxruntime-genai's append_tokens); copy the model's tokenizer files into it for text prompts (thinker "
    "generate, og.Tokenizer)"
)


# --- figures for the report ---------------------------------------------------------------------------------------
def count_ops(graph: onnx.GraphProto) -> Counter:
    """Node count by op type, control-flow bodies included."""
    return Counter(node.op_type for node in all_nodes(graph))


def versions() -> dict[str, str]:
    import onnxruntime
    import transformers

    return {
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
