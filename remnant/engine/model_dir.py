"""Generate an HF-style model directory for the embedded engine.

config.json carries the architecture (DeepSeek-V4 names) and the weight seed; weights are
generated from the seed when the server loads, so nothing large is written or committed.
The tokenizer is byte-level (token id = byte value, plus BOS/EOS) in the `tokenizers`
format, with a tokenizer_config.json (and a chat template), so stock loaders (tokenizers,
transformers' AutoTokenizer) read it. The command: remnant.cli.model_dir.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
BYTE_VOCAB = 256
BOS_ID = BYTE_VOCAB
EOS_ID = BYTE_VOCAB + 1
#: DeepSeek's chat layout: BOS, system text, then <｜User｜>/<｜Assistant｜> turns, each
#: answer closed by EOS. The markers are plain text to the byte-level tokenizer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'developer'] %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜>"
    "{% else %}{{ raise_exception('unknown role ' ~ message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
ARCHITECTURE = "RemnantDeepseekV4ForCausalLM"
MODEL_TYPE = "remnant_deepseek_v4"

_ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "intermediate_size",
    "compress_ratios",
    "window_size",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "max_position_embeddings",
    "rope_theta",
    "compress_rope_theta",
    "seed",
    "o_lora_rank",
    "o_groups",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "expert_dtype",
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer():
    """A byte-level tokenizer: ids 0..255 are bytes, then BOS and EOS; BOS is prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID), (EOS, EOS_ID)]
    )
    return tok


def hf_config(model: dict) -> dict:
    """config.json content for an architecture dict (remnant.config.ModelConfig fields)."""
    if model["vocab_size"] < EOS_ID + 1:
        raise ValueError(f"model.vocab_size={model['vocab_size']} is too small; the tokenizer needs >= {EOS_ID + 1}")
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": 512,
        "qk_nope_head_dim": 448,
        "qk_rope_head_dim": 64,
        "num_key_value_heads": 1,
        "torch_dtype": "float32",
    }
    cfg.update({k: model[k] for k in _ARCH_FIELDS})
    cfg["remnant"] = {"preset": model.get("name"), "weights": "random, generated from seed at load"}
    return cfg


def write_model_dir(model: dict, out: Path) -> Path:
    """Write config.json and tokenizer files for `model` into `out` (created). A write that
    fails raises remnant.records.files.WriteError naming the file (`cannot write
    out/tokenizer.json: No space left on device`)."""
    from remnant.records.files import write_text, writing

    out = Path(out)
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
    write_text(out / "config.json", json.dumps(hf_config(model), indent=2) + "\n")
    # Through Python, not Tokenizer.save: its error on a full disk is a bare Exception
    # naming no file. The text is the same (save writes it pretty).
    write_text(out / "tokenizer.json", build_tokenizer().to_str(pretty=True))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "model_max_length": model["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    write_text(out / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2) + "\n")
    write_text(out / "special_tokens_map.json", json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2) + "\n")
    return out
