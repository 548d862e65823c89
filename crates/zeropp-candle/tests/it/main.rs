//! zeropp-candle's tests, in one binary: the stage-by-stage protocol against
//! one candle graph and finite differences (`protocol`), sharded training
//! against single-rank training and checkpoints (`training`), the errors a
//! model gets (`errors`), and the export into candle-transformers' Llama
//! (`export`). The memory measurement is `tests/memory.rs` (its own process).
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap: a panic is a test failure

mod errors;
mod export;
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
