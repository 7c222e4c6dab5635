"""train_tldr.py's memory model: one GRPO optimizer step of grpo_multistep.py, from a model config and a
GRPOConfig, and fit_gpu, which chooses how the demo runs on a GPU's free memory before anything loads.

estimate_step_memory(config, args, ...) returns named terms in bytes and the peak: the largest of the phases'
totals (generation, training forward and backward, the all-reduce, AdamW's step), each the sum of what is
alive then. Checked against peak RSS on a 2-core CPU (python -m experiments.measure_memory; the figures:
docs/memory-model.md).

Modeled: weights, gradients and AdamW's moments (trainable ones, float32); π_ref's copy; what autograd saves
in a training micro-batch, with and without gradient checkpointing; the gradients that autograd holds back
while prompt sharing's two passes meet; the LM head's chunked logits; generation's KV cache and logits;
torchrun's flat gradient copy; the process's baseline (imports: a parameter); on CPU, the freed activations
that glibc keeps resident (`retention`, an allocator effect, measured). Left out: the no-grad π_old/π_ref
passes (a layer's temporaries and a head chunk at a time: below the training pass), a layer's temporaries in
backward, attention masks, cos/sin, prompts and metrics (kilobytes to a few MB), CUDA's caching-allocator
slack, kernels' workspaces. Prompts are max_prompt_length long, completions max_completion_length (no EOS):
the worst case, the one that random weights produce.
"""
import dataclasses
import importlib.util
import inspect
import math
import sys

import torch
import transformers

CHUNK = 256  # grpo_multistep.CHUNK: the LM head's tokens per chunk (not imported: no trainer needed)
# Qwen2.5-0.5B's published config, the pr2899 preset's model: estimates without a download
QWEN25_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # train_tldr.py's adapter: the attention projections
# A LoRA adapter's learning rate: 10 times the whole model's, as TRL's "LoRA Without Regret" guide runs GRPO
# (1e-5 against 1e-6), after Schulman et al. 2025, whose best LoRA rates were about 10 times full fine-tuning.
LORA_RATE_FACTOR = 10


def dims(config):
    H, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or H // heads
    return H, config.intermediate_size, config.num_hidden_layers, config.vocab_size, heads, kv, d


def param_count(config):
    """Every parameter once (a tied LM head is the embedding): sum(p.numel() for p in model.parameters())."""
    H, I, L, V, heads, kv, d = dims(config)
    qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)  # Qwen2: q, k, v
    o_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)  # Llama: all four
    attention = 2 * H * heads * d + 2 * H * kv * d + qkv_bias * (heads + 2 * kv) * d + o_bias * H
    mlp = 3 * H * I + getattr(config, "mlp_bias", False) * (2 * I + H)  # gate, up, down
    head = 0 if config.tie_word_embeddings else V * H
    return V * H + L * (attention + mlp + 2 * H) + H + head  # (+ 2 RMSNorms a layer, the final one)


def linear_param_count(config):  # the weights that bf16 autocast casts (and caches) in each forward
    H, I, L, V, heads, kv, d = dims(config)
    return L * (2 * H * heads * d + 2 * H * kv * d + 3 * H * I) + V * H


def lora_param_count(config, rank=16, targets=LORA_TARGETS):
    """A LoRA adapter's parameters: rank × (in + out) per targeted projection and layer."""
    H, I, L, V, heads, kv, d = dims(config)
    shapes = dict(q_proj=(H, heads * d), k_proj=(H, kv * d), v_proj=(H, kv * d), o_proj=(heads * d, H),
                  gate_proj=(H, I), up_proj=(H, I), down_proj=(I, H))
    return L * sum(rank * sum(shapes[t]) for t in targets)


def activation_bytes(config, args, element, prompt_length, checkpointing=None):
    """What autograd saves in a training micro-batch (per_token_logps, TokenLogps): (all, the prompt pass's).

    Per layer and token (counted by saved_tensors_hooks, Qwen2 and Llama, transformers 5, SDPA): the layer's
    input (the residual stream), RMSNorm's normalized x and output (q, k, v's input), q after RoPE, the
    attention's output (o_proj's input: one storage), the mid-layer residual, the second norm's normalized x
    and output: 8 vectors of H; the MLP's gate, up, SiLU(gate) and their product (down's input): 4 of I. And
    the attention's K and V, expanded to all heads (repeat_kv: SDPA gets a mask) over the keys' length.
    Without checkpointing, prompt sharing: each distinct prompt of the b completions runs once (P tokens,
    its own K, V), the b·C completion tokens attend to its cache (P + C keys); after the layers, the final
    norm's input and normalized x, the LM head's input (b·C, H).
    Gradient checkpointing (checkpointing None: args'): one pass over b·(P + C) tokens; each layer keeps its
    input only, backward rebuilds one layer at a time (its full activations, counted once); final norm and
    LM head as above."""
    H, I, L, V, heads, kv, d = dims(config)
    b, G, P = args.per_device_train_batch_size, args.num_generations, prompt_length
    C, per_token = args.max_completion_length, 8 * H + 4 * I
    if args.gradient_checkpointing if checkpointing is None else checkpointing:
        N = b * (P + C)  # tokens of the one pass
        layer = N * per_token + 2 * b * heads * (P + C) * d  # the layer that backward rebuilds
        return element * (L * N * H + 2 * N * H + b * C * H + layer), 0
    prompts = 1 + math.ceil((b - math.gcd(b, G)) / G)  # distinct prompts in b adjacent rows, at worst
    completion_layer = b * C * per_token + 2 * b * heads * (P + C) * d
    prompt_pass = element * prompts * (L * (P * per_token + 2 * heads * P * d) + 2 * P * H)
    return element * (L * completion_layer + 3 * b * C * H) + prompt_pass, prompt_pass


def estimate_step_memory(config, args, world_size=1, lora_params=None, base_dtype=torch.float32, baseline=0,
                         first_step=False, device="cpu", prompt_length=None):
    """Bytes of one optimizer step: {term: bytes, ..., "phase_<name>": totals, "peak": the largest phase}.

    config: a transformers PretrainedConfig (Llama, Qwen2); args: a grpo_multistep.GRPOConfig. lora_params:
    the adapter's parameter count (lora_param_count), None: a full fine-tune. base_dtype: the frozen base
    weights' dtype with LoRA (trainable weights are float32: the trainer refuses 16-bit ones). baseline: the
    process's bytes before the model (CPU: the RSS of the imports, measured; CUDA: the context's).
    first_step: AdamW's moments are allocated in the first step's optimizer phase (what a max_steps=1 run
    sees); later steps hold them throughout. device "cpu" adds `retention`. prompt_length: max_prompt_length
    unless given."""
    H, I, L, V, heads, kv, d = dims(config)
    P, C = prompt_length or args.max_prompt_length, args.max_completion_length
    b = args.per_device_train_batch_size
    f32, n_params, tied = 4, param_count(config), config.tie_word_embeddings
    base = torch.empty((), dtype=base_dtype).element_size() if lora_params else f32
    trainable = lora_params or n_params
    element = 2 if args.bf16 else f32  # under bf16 autocast the linears' outputs (and saved inputs) are bf16
    c, chunks, E = min(CHUNK, b * C), math.ceil(b * C / CHUNK), V * H * f32  # E: an embedding's gradient
    activations, prompt_pass = activation_bytes(config, args, element, P)
    t = {"baseline": baseline,
         "weights": n_params * base + (lora_params or 0) * f32,
         "gradients": trainable * f32,
         "adam_moments": 2 * trainable * f32,  # exp_avg, exp_avg_sq
         # π_ref: a frozen deepcopy of the policy when beta > 0; a PeftModel is its own, its adapter disabled
         "reference": n_params * f32 if args.beta > 0 and not lora_params else 0,
         # bf16 autocast over float32 weights casts each linear's weight once per forward (its cache), and
         # autograd saves the copies until backward
         "autocast_copies": 2 * linear_param_count(config) if args.bf16 and base == f32 else 0,
         "activations": activations,
         # TokenLogps forward: the chunk's float32 logits z and logsumexp's exp(z - max), (c, V) each
         "lm_head_forward": c * V * (2 * f32 + 2 * args.bf16),
         # backward: z again, made the gradient in place; a trainable head (not with LoRA): the chunk's (V, H)
         # weight gradient and, past one chunk, autograd's input buffer that sums the chunks' before .grad
         "lm_head_backward": c * V * f32 + (c * H * f32 if lora_params else E * (1 + (chunks > 1)))}
    # Prompt sharing: each weight serves the prompt pass and the completion pass, so autograd keeps its
    # gradient from the completion pass in an input buffer until the prompt pass's backward adds its own:
    # a copy of the layers' gradients. The peak is at the completion pass's embedding backward: those, the
    # prompt pass's activations, the embedding's new dense (V, H) gradient and, tied, the head's gradient,
    # buffered as it waits for the embedding's (measured: docs/memory-model.md). Checkpointing: one pass, only
    # the embeddings' two.
    layers = (lora_params or n_params - V * H * (2 - tied)) * f32  # trainable weights but the embeddings
    embeddings = 0 if lora_params else E * (1 + tied)
    t["pending_gradients"] = embeddings + (0 if args.gradient_checkpointing else layers)
    seqs = (args.steps_per_generation or args.gradient_accumulation_steps) * b  # B·G of a generation batch
    # KV cache: K and V of every layer, kv heads, P + C positions (autocast: bf16); then the last position's
    # logits (float32) and sample_token's float64 probabilities and their cumulative sum
    t["kv_cache"] = L * 2 * seqs * kv * d * (P + C) * element
    t["generation_logits"] = seqs * V * (f32 + 8 + 8)
    # torchrun: all_reduce_gradients torch.cat()s every gradient into one flat float32 buffer
    t["all_reduce"] = trainable * f32 if world_size > 1 else 0
    # CPU: glibc keeps freed blocks under its 32 MiB mmap threshold in its heap. A micro-batch's activations
    # are such blocks, freed while longer-lived ones (gradients; with checkpointing, the layers' inputs) are
    # allocated among them, and later allocations do not refill all the holes. Measured: about as much stays
    # resident as the micro-batch's activations without checkpointing (0.4 to 1.4 times; docs/memory-model.md)
    uncheckpointed = activation_bytes(config, args, element, P, checkpointing=False)[0]
    t["retention"] = uncheckpointed if device == "cpu" else 0
    moments = 0 if first_step else t["adam_moments"]
    static = t["baseline"] + t["weights"] + t["reference"] + moments
    grads = t["gradients"] if args.gradient_accumulation_steps > 1 else 0  # from the 2nd micro-batch on
    extra = t["retention"] + t["autocast_copies"]  # (autocast's copies: in forward and backward only)
    backward = max(activations + t["lm_head_backward"], prompt_pass + t["pending_gradients"])
    phases = {"generate": static + t["kv_cache"] + t["generation_logits"],
              "forward": static + grads + extra + activations + t["lm_head_forward"],
              "backward": static + t["gradients"] + extra + backward,
              "all_reduce": static + t["gradients"] + t["all_reduce"] + t["retention"],
              "optimizer": static + t["gradients"] + t["adam_moments"] - moments + t["retention"]}
    return {**t, **{f"phase_{k}": v for k, v in phases.items()}, "peak": max(phases.values())}


# ---- The demo on a GPU: what fits its free memory, chosen before anything loads (train_tldr.py) ----------
# The estimate times MARGIN must fit: the caching allocator reserves more than it allocates (an assumption).
MARGIN, GIB = 1.1, 2**30


def cuda_free_bytes():  # the GPU's free memory, its CUDA context already taken: the one place that reads it
    return torch.cuda.mem_get_info()[0]


def native_bf16():
    """Whether the GPU computes bf16 in hardware (NVIDIA: compute capability 8.0, Ampere, and later).
    torch.cuda.is_bf16_supported() also says yes where bf16 is only emulated (T4, V100, RTX 20xx): no bf16
    units to gain speed from, and autocast's weight copies cost memory. including_emulation=False leaves
    those cards out."""
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability() >= (8, 0)  # a torch without the argument: the same rule


def peak_memory_gib():
    """train_tldr.py's memory metrics: the process's peak resident memory where the OS reports it, and on
    CUDA torch.cuda.max_memory_allocated. The `resource` module is Unix's: native Windows goes without."""
    peaks = {}
    if importlib.util.find_spec("resource"):
        import resource
        unit = 1 if sys.platform == "darwin" else 2**10  # ru_maxrss counts bytes on macOS, KiB on Linux
        peaks["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / GIB
    if torch.cuda.is_available():
        peaks["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / GIB
    return peaks


def cuda_peak(config, args, lora_rank, world_size):  # a step after the first (AdamW's moments held)
    kwargs = args.model_init_kwargs or {}
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "float32"))  # (torch_dtype: the older name)
    dtype = getattr(torch, dtype, torch.float32) if isinstance(dtype, str) else dtype  # "auto": as float32
    lora_params = lora_param_count(config, lora_rank) if lora_rank else None
    return estimate_step_memory(config, args, world_size, lora_params, dtype, device="cuda")["peak"]


def flags(given, args, lora_rank, *more):  # the train_tldr.py flags that choose this way over `given`'s
    chosen = ["--bf16 False"] if given.bf16 and not args.bf16 else []
    if args.gradient_checkpointing:
        chosen.append("--gradient_checkpointing True")
    if lora_rank is not None:
        chosen.append(f"--lora {lora_rank}")
    return " ".join([*chosen, *more])


def lora_weights(args):  # an adapter's frozen base: bfloat16 under bf16 autocast, which computes in it anyway
    kwargs = args.model_init_kwargs or {}
    if not args.bf16 or "dtype" in kwargs or "torch_dtype" in kwargs:  # float32, or the user's own choice
        return args
    return dataclasses.replace(args, model_init_kwargs={**kwargs, "dtype": "bfloat16"})


def lora_rate(args, lora_rank, given):
    """args with an adapter's learning rate, LORA_RATE_FACTOR times the whole model's, said on the console;
    as they are without an adapter, or where --learning_rate is given (given)."""
    if lora_rank is None or given:
        return args
    args = dataclasses.replace(args, learning_rate=args.learning_rate * LORA_RATE_FACTOR)
    print(f"LoRA (rank {lora_rank}): learning rate {args.learning_rate:g}, {LORA_RATE_FACTOR} times the "
          "whole model's, as TRL's LoRA Without Regret guide runs GRPO (--learning_rate sets another)",
          flush=True)
    return args


def on_cuda(args, lora_rank, model, world_size=1, bf16=None, as_given=False):
    """train_tldr.py on CUDA: bf16 autocast over float32 weights where the card computes bf16 natively
    (bf16: the user's choice; None: that rule), then fit_gpu on that choice. (args, lora_rank)."""
    native = native_bf16()
    args = dataclasses.replace(args, bf16=native if bf16 is None else bf16)
    print(f"GPU: {'bf16 autocast over float32 weights' if args.bf16 else 'float32'} (the card computes bf16 "
          f"natively: {native}{'; --bf16 as given' if bf16 is not None else ''})", flush=True)
    return fit_gpu(args, lora_rank, model, world_size, as_given=as_given)


def fit_gpu(args, lora_rank, model, world_size=1, free=None, as_given=False):
    """(args, lora_rank): the first of these whose estimated peak, times MARGIN, fits the GPU's free memory:
    the run as given; with gradient checkpointing (the same updates, more time); where args.bf16, float32
    with checkpointing (autocast's bfloat16 weight copies cost more than its smaller activations save);
    a LoRA adapter of rank 16 (train_tldr.py's --lora; another learning rate, fewer weights), on bfloat16
    base weights where args.bf16; that with checkpointing. One passed over because it fits only without
    the margin is named: it may not fit, and the flags of each choice are printed. None fits: SystemExit,
    naming what to set. model: a folder or hub id (only its config is read), or a config. free: bytes
    (None: cuda_free_bytes()). --lora given: that adapter, with checkpointing if need be. as_given
    (--as_given), or under torchrun (world_size > 1): the run as given, only checked (each rank reads its
    own GPU, and ranks that chose differently would train different models); as_given runs it even where
    it does not fit."""
    replace = dataclasses.replace
    remote = bool((args.model_init_kwargs or {}).get("trust_remote_code"))  # as the trainer will load it
    if isinstance(model, transformers.PretrainedConfig):
        config = model
    else:
        config = transformers.AutoConfig.from_pretrained(model, trust_remote_code=remote)
    args = args if lora_rank is None else lora_weights(args)
    lora, on = lora_weights(args), " on bfloat16 weights" if args.bf16 else ""
    options = [("as given", args, lora_rank)]
    if not args.gradient_checkpointing:
        options.append(("with gradient checkpointing", replace(args, gradient_checkpointing=True), lora_rank))
    if args.bf16 and lora_rank is None:  # the whole model at its own rate, so before an adapter's other one
        options.append(("float32 with gradient checkpointing",
                        replace(args, bf16=False, gradient_checkpointing=True), None))
    if lora_rank is None and importlib.util.find_spec("peft"):  # (else the refusal says to install it)
        checkpointed = replace(lora, gradient_checkpointing=True)
        options += [(f"LoRA (rank 16){on}", lora, 16), (f"LoRA (rank 16){on} with gradient checkpointing",
                                                        checkpointed, 16)]
    options = options[:1] if world_size > 1 or as_given else options
    try:
        peaks = [cuda_peak(config, option, rank, world_size) for _, option, rank in options]
    except AttributeError as e:  # a config whose sizes have other names (GPT-2's n_inner): no estimate
        print(f"GPU: no memory estimate for a {config.model_type} model ({e}): running as given")
        return args, lora_rank
    free = cuda_free_bytes() if free is None else free
    needs = ", ".join(f"{name} {peak / GIB:.1f} GiB" for (name, _, _), peak in zip(options, peaks))
    compute = "bf16 autocast" if args.bf16 else "float32"
    print(f"GPU: {free / GIB:.1f} GiB free; a step's estimated peak ({compute}; tldr/memory.py's, not "
          f"measured on a GPU): {needs}", flush=True)
    risky = None  # the first way passed over that fits, but not with the margin: it may not fit
    for (name, option, rank), peak in zip(options, peaks):
        if peak * MARGIN <= free or as_given:
            if risky:
                print(f"GPU: {risky[0]} may not fit ({risky[1] / GIB:.1f} GiB, within the {MARGIN - 1:.0%} "
                      f"margin). Choose: `{flags(args, *risky[2:], '--as_given')}` runs it (it may run out "
                      f"of memory), `{flags(args, option, rank)}` runs {name}", flush=True)
            print(f"GPU: running {name}" + (" (it may not fit)" if peak * MARGIN > free else ""), flush=True)
            return option, rank
        if peak <= free and risky is None:
            risky = (name, peak, option, rank)
    hint = ""
    if risky:
        hint = f"; {risky[0]} may fit without the margin: `{flags(args, *risky[2:], '--as_given')}` tries it"
    elif world_size > 1:
        hint = "; under torchrun nothing is changed for you: add --gradient_checkpointing True or --lora"
    elif lora_rank is None and not importlib.util.find_spec("peft"):
        hint = "; with peft installed (pip install peft), LoRA is tried too"
    raise SystemExit(f"error: the GPU has {free / GIB:.1f} GiB free, and no way of running this fits "
                     f"with its {MARGIN - 1:.0%} margin (a step's estimated peak: {needs}): lower "
                     "--per_device_train_batch_size (more --gradient_accumulation_steps keep the step's "
                     f"size) or --max_completion_length, or choose a smaller --model{hint}")
