//! The errors a candle model gets: a weight, part of one, or a stage input
//! behind an op without a backward pass is a named error at build, never a
//! silent zero; so is a name asked for twice undeclared; bad model
//! definitions are refused when the model is built.

use candle_core::{D, Tensor};
use candle_nn::Module;
use zeropp_candle::model::CandleModelBuilder;
use zeropp_candle::{CandleError, CandleModel};
use zeropp_engine::model::{Model, full_forward_backward, init_params};

use crate::batch;

#[test]
fn a_weight_behind_fused_rms_norm_is_a_named_error_at_build() {
    let (vocab, d) = (10, 8);
    let err = CandleModel::builder("fused", vocab, 4)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        // candle-nn's fused kernel: no backward pass to its weight.
        .stage("norm", move |vb, x| candle_nn::ops::rms_norm(x, &vb.get(d, "gain")?, 1e-5))
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
        .build()
        .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("\"norm\"") && msg.contains("\"gain\"") && msg.contains("no gradient"), "{msg}");
    assert!(
        msg.contains("rms_norm") && msg.contains("zeropp_candle::ops"),
        "the message names cause and fix: {msg}"
    );
}

#[test]
fn a_stage_input_without_gradient_is_a_named_error_at_build() {
    let (vocab, d) = (10, 8);
    let err = CandleModel::builder("cut", vocab, 4)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        // The weight has a gradient, the stage input none (detached).
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(&x.detach()))
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"head\"") && err.contains("input received no gradient"), "{err}");
}

/// One attention stage with a fused q/k/v projection; `softmax` is the
/// attention's softmax over the last dimension.
fn fused_qkv(softmax: fn(&Tensor) -> candle_core::Result<Tensor>) -> CandleModelBuilder {
    let (vocab, d) = (12, 8);
    CandleModel::builder("qkv", vocab, 6)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage("attn", move |vb, x| {
            let qkv = candle_nn::linear_no_bias(d, 3 * d, vb.pp("qkv"))?.forward(x)?;
            let (q, k, v) = (qkv.narrow(2, 0, d)?, qkv.narrow(2, d, d)?, qkv.narrow(2, 2 * d, d)?);
            let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
            x + softmax(&scores)?.matmul(&v)?
        })
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
}

/// The issue's case: the query and key rows of a fused q/k/v weight sit
/// behind candle-nn's `softmax_last_dim` (no backward), the value rows do
/// not; the weight as a whole gets a gradient, so only an element-wise check
/// sees it.
#[test]
fn a_fused_qkv_behind_softmax_last_dim_fails_at_build_with_its_rows() {
    let Err(err) = fused_qkv(candle_nn::ops::softmax_last_dim).build() else {
        panic!(
            "a fused q/k/v weight behind softmax_last_dim built: its query and key rows would train on zeros"
        );
    };
    assert!(matches!(err, CandleError::PartialGradient { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("\"attn\"") && msg.contains("\"qkv.weight\""), "{msg}");
    assert!(msg.contains("128 of 192 elements (rows 0..16)"), "the query and key rows, and only them: {msg}");
    // With zeropp's op (a backward pass), the same model builds, and its
    // gradients equal the composite softmax's.
    let ours = fused_qkv(zeropp_candle::ops::softmax_last_dim).build().unwrap();
    let composite = fused_qkv(|s| candle_nn::ops::softmax(s, D::Minus1)).build().unwrap();
    let params = init_params(&ours, 4).unwrap();
    let b = batch(12, 2, 6, 3);
    let (la, ga) = full_forward_backward(&ours, &params, &b).unwrap();
    let (lb, gb) = full_forward_backward(&composite, &params, &b).unwrap();
    assert!((la - lb).abs() < 1e-6, "{la} vs {lb}");
    for (x, y) in ga.iter().flatten().zip(gb.iter().flatten()) {
        assert!((x - y).abs() <= 1e-4 * x.abs().max(1e-2), "{x} vs {y}");
    }
}

/// Freezing part of a weight on purpose (the old token rows of an extended
/// embedding, detached) cuts their gradient: refused, and accepted once
/// declared. A pruning mask (`w * mask`) needs no declaration: the masked
/// elements change nothing, so their zero gradient is the true one.
#[test]
fn a_declared_partial_gradient_builds() {
    let (vocab, d) = (10, 8);
    let builder = move |allow: bool| {
        let b = CandleModel::builder("frozen-rows", vocab, 4)
            .stage("embed", move |vb, ids| {
                let w = vb.get((vocab, d), "weight")?;
                let w = Tensor::cat(&[w.narrow(0, 0, 6)?.detach(), w.narrow(0, 6, vocab - 6)?], 0)?;
                candle_nn::Embedding::new(w, d).forward(ids)
            })
            .stage("head", move |vb, x| {
                let w = vb.get((vocab, d), "weight")?;
                let mask: Vec<f32> = (0..vocab * d).map(|i| if i % 3 == 0 { 0.0 } else { 1.0 }).collect();
                let w = (w * Tensor::from_vec(mask, (vocab, d), x.device())?)?;
                x.broadcast_matmul(&w.t()?)
            });
        if allow { b.allow_partial_gradient("embed.weight") } else { b }
    };
    let err = builder(false).build().unwrap_err().to_string();
    assert!(
        err.contains("allow_partial_gradient(\"embed.weight\")")
            && err.contains("48 of 80 elements (rows 0..6)"),
        "{err}"
    );
    builder(true).build().unwrap();
}

/// Two modules on one path share a weight silently in candle-nn; here it is
/// an error unless declared.
#[test]
fn a_name_asked_for_twice_is_an_error_unless_declared() {
    let (vocab, d) = (10, 8);
    let builder = || {
        CandleModel::builder("copy", vocab, 4)
            .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
            .stage("block", move |vb, x| {
                let a = candle_nn::linear(d, d, vb.pp("fc"))?.forward(x)?.tanh()?;
                // Copy-pasted: the second layer asks for fc's weights again.
                candle_nn::linear(d, d, vb.pp("fc"))?.forward(&a)
            })
            .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
    };
    let err = builder().build().unwrap_err().to_string();
    assert!(err.contains("\"block\"") && err.contains("\"fc.weight\"") && err.contains(".shared("), "{err}");
    let model = builder().shared("block.fc.weight").shared("block.fc.bias").build().unwrap();
    assert_eq!(model.layers()[1].params.len(), 2);
}

/// After the build, the per-step check still refuses a weight that loses
/// its gradient (a stage that switches to a fused op mid-training).
#[test]
fn the_per_step_check_catches_a_gradient_lost_after_build() {
    let (vocab, d) = (10, 8);
    let built = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let switched = built.clone();
    let model = CandleModel::builder("switch", vocab, 4)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage("norm", move |vb, x| {
            let w = vb.get(d, "gain")?;
            // The build's runs see the op with a backward; training, after it, candle-nn's.
            if switched.load(std::sync::atomic::Ordering::SeqCst) {
                candle_nn::ops::rms_norm(x, &w, 1e-5)
            } else {
                zeropp_candle::ops::rms_norm(x, &w, 1e-5)
            }
        })
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
        .build()
        .unwrap();
    built.store(true, std::sync::atomic::Ordering::SeqCst);
    let params = init_params(&model, 1).unwrap();
    let err = full_forward_backward(&model, &params, &batch(vocab, 2, 4, 0)).unwrap_err().to_string();
    assert!(err.contains("\"norm\"") && err.contains("\"gain\"") && err.contains("no gradient"), "{err}");
}

#[test]
fn bad_models_are_refused_when_built() {
    let (vocab, d) = (10, 8);
    let embed = move |vb: candle_nn::VarBuilder<'_>, ids: &candle_core::Tensor| {
        candle_nn::embedding(vocab, d, vb)?.forward(ids)
    };
    let cases: [(CandleModelBuilder, &str); 4] = [
        (CandleModel::builder("empty", vocab, 4), "no stages"),
        (CandleModel::builder("short", vocab, 4).stage("embed", embed), "not logits"),
        (
            CandleModel::builder("r", vocab, 4)
                .stage("persistent", embed)
                .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x)),
            "reserved",
        ),
        (
            CandleModel::builder("f", vocab, 4)
                .stage("embed", embed)
                .stage("head", move |vb, x| candle_nn::linear(d + 1, vocab, vb)?.forward(x)),
            "\"head\" failed",
        ),
    ];
    for (builder, says) in cases {
        let err = builder.build().map(|_| ()).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
}

/// A weight used twice, once through candle-nn's `softmax_last_dim` (no
/// backward): every element still gets a gradient (through the other use),
/// a wrong one. The build's directional test names it; the same model on
/// `zeropp_candle::ops` builds, and a declaration accepts the cut.
#[test]
fn a_weight_with_one_of_two_paths_cut_fails_at_build() {
    let (vocab, d) = (10, 8);
    let model = |softmax: fn(&Tensor) -> candle_core::Result<Tensor>| {
        CandleModel::builder("two-paths", vocab, 4)
            .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
            .stage("mix", move |vb, x| {
                let h = candle_nn::linear_no_bias(d, d, vb.pp("fc"))?.forward(x)?;
                (&h + softmax(&(&h * 3.0)?)?)? + x
            })
            .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
    };
    let err = model(candle_nn::ops::softmax_last_dim).build().unwrap_err();
    let CandleError::WrongGradient { stage, param, backward, differences } = &err else {
        panic!("expected WrongGradient, got {err}")
    };
    assert_eq!((stage.as_str(), param.as_str()), ("mix", "fc.weight"), "{err}");
    assert!((backward - differences).abs() > 0.05 * differences.abs(), "{err}");
    assert!(err.to_string().contains("allow_partial_gradient(\"mix.fc.weight\")"), "{err}");
    model(zeropp_candle::ops::softmax_last_dim).build().unwrap();
    model(candle_nn::ops::softmax_last_dim).allow_partial_gradient("mix.fc.weight").build().unwrap();
}
