//! The build's gradient check holds one stage at a time (issue 38 §1): its
//! peak heap stays within 1.2x of the largest stage's own trial footprint (its
//! f32 weights, its forward and backward on the check's trial input: what
//! running that one stage costs), far below the whole model, which the check
//! of earlier releases held twice over (weights and gradients of every stage,
//! at least 8 bytes a parameter).
//!
//! The measure is a counting global allocator's peak of live heap bytes; this
//! binary holds one test, so nothing else allocates meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap: a panic is a test failure

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use zeropp_candle::LlamaConfig;
use zeropp_candle::llama::{Tables, block_with};

#[global_allocator]
static ALLOC: zeropp_tests::heap::Counting = zeropp_tests::heap::Counting;

/// Peak heap bytes of one decoder layer's forward and backward in f32 on
/// `rows` sequences (the footprint of running that stage once, weights made
/// inside the window).
fn layer_footprint(c: &LlamaConfig, rows: usize) -> usize {
    let tables = Tables::new(c, c.seq_len, &Device::Cpu).unwrap();
    let x = Var::from_tensor(&Tensor::ones((rows, c.seq_len, c.d_model), DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    let window = zeropp_tests::heap::Window::start();
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let y = block_with(c, &tables, vb.pp("layer"), x.as_tensor()).unwrap();
    let up = Tensor::ones(y.shape(), DType::F32, &Device::Cpu).unwrap();
    let grads = (y * up).unwrap().sum_all().unwrap().backward().unwrap();
    let peak = window.peak();
    drop(grads);
    peak
}

#[test]
fn the_build_holds_one_stage_at_a_time() {
    // 8 decoder layers of d 384 (1.8M parameters each) dominate a small
    // vocabulary's embedding and head: the model is 8x its largest stage.
    let c = LlamaConfig::shape(256, 384, 8, 6, 2, 64);
    let params = c.num_params();
    let footprint = layer_footprint(&c, 2);
    let window = zeropp_tests::heap::Window::start();
    let model = c.build().unwrap();
    let peak = window.peak();
    assert!(model.gradient_check_notes().is_empty(), "{:?}", model.gradient_check_notes());
    let old = 8 * params;
    eprintln!(
        "build of a {:.2}M-parameter Llama: peak heap {:.2} MB = {:.3}x the largest stage's footprint ({:.2} MB), \
         {:.3}x the f32 model ({:.2} MB); the old check held at least {:.2} MB",
        params as f64 / 1e6,
        peak as f64 / 1e6,
        peak as f64 / footprint as f64,
        footprint as f64 / 1e6,
        peak as f64 / (4 * params) as f64,
        4.0 * params as f64 / 1e6,
        old as f64 / 1e6,
    );
    assert!(peak as f64 <= 1.2 * footprint as f64, "peak {peak} B > 1.2 x the largest stage's {footprint} B");
    // The bound is one the old check (the whole model's weights and gradients) fails.
    assert!(1.2 * (footprint as f64) < old as f64, "the model is too small for the test to tell");
}
