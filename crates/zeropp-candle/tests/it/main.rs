//! zeropp-candle's tests, in one binary: the stage-by-stage protocol against
//! one candle graph and finite differences (`protocol`), sharded training
//! against single-rank training and checkpoints (`training`), the errors a
//! model gets (`errors`), and the export into candle-transformers' Llama
//! (`export`). The memory measurement is `tests/memory.rs` (its own process).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap: a panic is a test failure

mod errors;
mod export;
mod gradcheck;
mod ops;
mod protocol;
mod ties;
mod training;

use zeropp_candle::{CandleModel, LlamaConfig};
use zeropp_engine::model::Batch;

/// A tiny Llama (d 16, 2 layers, 4 heads, 2 key/value heads, seq 8) over `vocab` ids.
fn tiny_llama(vocab: usize) -> CandleModel {
    LlamaConfig::shape(vocab, 16, 2, 4, 2, 8).build().unwrap()
}

/// A deterministic batch of `b` sequences of `t` tokens below `vocab`.
fn batch(vocab: usize, b: usize, t: usize, salt: u32) -> Batch {
    let tok = |i: u32| (i.wrapping_mul(2_654_435_761).wrapping_add(salt) >> 7) % vocab as u32;
    Batch {
        inputs: (0..(b * t) as u32).map(tok).collect(),
        targets: (1..=(b * t) as u32).map(tok).collect(),
        batch: b,
        seq_len: t,
    }
}

/// candle-transformers' Llama config for `c` (Hugging Face's fields).
fn hf_config(c: &LlamaConfig, tie_word_embeddings: bool) -> candle_transformers::models::llama::Config {
    candle_transformers::models::llama::Config {
        hidden_size: c.d_model,
        intermediate_size: c.d_ff,
        vocab_size: c.vocab,
        num_hidden_layers: c.n_layer,
        num_attention_heads: c.n_head,
        num_key_value_heads: c.n_kv_head,
        use_flash_attn: false,
        rms_norm_eps: c.eps,
        rope_theta: c.rope_theta,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: c.seq_len,
        tie_word_embeddings,
    }
}
