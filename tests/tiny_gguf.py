"""Write a tiny llama-architecture GGUF with random weights, for fast engine tests.

Its text is random, which is fine for mechanics (reuse counts, batching equality,
eviction/restore, cancellation); its vocabulary is the 256 byte tokens, so multi-byte UTF-8
characters are split across tokens, which is what a streaming-UTF-8 test needs.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, seed: int = 0, n_layers: int = 2, dim: int = 64, heads: int = 4) -> Path:
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte
    n_vocab, ff = len(tokens), dim * 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_context_length(2048)
    w.add_embedding_length(dim)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(dim // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.5).astype(np.float32))

    t("token_embd.weight", n_vocab, dim)
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(dim, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"blk.{i}.{name}.weight", dim, dim)
        t(f"blk.{i}.ffn_gate.weight", ff, dim)
        t(f"blk.{i}.ffn_up.weight", ff, dim)
        t(f"blk.{i}.ffn_down.weight", dim, ff)
    w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    t("output.weight", n_vocab, dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
