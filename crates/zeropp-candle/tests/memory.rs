//! Memory, measured: the peak heap of a thread-backend run of the candle
//! Llama against the engine's memory model (`memory_prediction_for`), at W =
//! 2, 4, 8, as the native GPT is measured (`zeropp-engine/tests/memory.rs`).
//!
//! All ranks run in this process, so the measure is the process's peak of live
//! heap bytes (a counting global allocator), divided by W, against the model's
//! per-rank prediction. The candle stages recompute in backward (the default),
//! so no stage's full weights outlive the engine's gather: the largest
//! allocation stays one gathered layer, far below the full model. This binary
//! holds one test, so no other test allocates meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap: a panic is a test failure

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use zeropp_candle::LlamaConfig;
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::data::TextDataset;
use zeropp_engine::train::{TrainConfig, memory_prediction_for, train_model};

/// The system allocator, counting live bytes, their peak and the largest block.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees hold; the counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (the caller upholds `alloc`'s contract).
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
            LARGEST.fetch_max(layout.size(), Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
            LARGEST.fetch_max(layout.size(), Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Relaxed);
            }
            LARGEST.fetch_max(new_size, Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A Llama of 2.5M parameters (d 192, 6 layers, 4 heads, 2 key/value heads),
/// short sequences so the sharded states, not the activations, dominate.
fn shape(vocab: usize) -> LlamaConfig {
    LlamaConfig::shape(vocab, 192, 6, 4, 2, 32)
}

#[test]
fn the_candle_llamas_peak_per_rank_is_within_the_memory_model() {
    let vocab = 64;
    let tokens: Vec<u32> =
        (0..40_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 9) % vocab as u32).collect();
    let data = TextDataset::from_tokens(vocab, tokens, 0.1).unwrap();
    let mut previous: Option<(usize, f64, f64)> = None;
    for world in [2, 4, 8] {
        let local = world.min(4);
        let model = shape(vocab).build().unwrap();
        let cfg = TrainConfig {
            world,
            local_size: local,
            steps: 2,
            eval_batches: 0,
            engine: EngineConfig {
                zero: ZeroConfig::zeropp(local),
                global_batch: 8,
                ..EngineConfig::default()
            },
            ..TrainConfig::default()
        };
        let p = memory_prediction_for(&model, &cfg).unwrap();
        let before = LIVE.load(Relaxed);
        PEAK.store(before, Relaxed);
        LARGEST.store(0, Relaxed);
        let r = train_model(&model, &data, &cfg).unwrap();
        assert!(r.summary.final_loss.is_finite());
        let per_rank = (PEAK.load(Relaxed) - before) as f64 / world as f64;
        let predicted = p.total() as f64;
        let largest = LARGEST.load(Relaxed);
        eprintln!(
            "candle llama ({} params), W={world}: measured {:.2} MB/rank, predicted {:.2} MB/rank (states {:.2}, \
             gathered layers {:.2}, activations {:.2}), ratio {:.3}; largest allocation {:.2} MB (full f32 model {:.2} MB)",
            shape(vocab).num_params(),
            per_rank / 1e6,
            predicted / 1e6,
            p.states as f64 / 1e6,
            p.transient_layers as f64 / 1e6,
            p.activations as f64 / 1e6,
            per_rank / predicted,
            largest as f64 / 1e6,
            p.full_f32_model as f64 / 1e6,
        );
        assert!(per_rank <= 1.15 * predicted, "W={world}: {per_rank} > 1.15 x {predicted}");
        assert!(largest < p.full_f32_model / 4, "W={world}: an allocation of {largest} B");
        if let Some((w0, m0, p0)) = previous {
            assert!(per_rank < m0, "W={w0} -> W={world}: the peak per rank did not fall");
            let (measured, model) = (per_rank / m0, predicted / p0);
            assert!(
                (measured / model - 1.0).abs() <= 0.25,
                "W={w0} -> W={world}: {measured:.3} vs {model:.3}"
            );
        }
        previous = Some((world, per_rank, predicted));
    }
}
