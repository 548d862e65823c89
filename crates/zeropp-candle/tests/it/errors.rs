//! The errors a candle model gets: a weight (or a stage input) behind an op
//! without a backward pass is a named error, never a silent zero; bad model
//! definitions are refused when the model is built.

use candle_nn::Module;
use zeropp_candle::CandleModel;
use zeropp_candle::model::CandleModelBuilder;
use zeropp_engine::model::{full_forward_backward, init_params};

use crate::batch;

#[test]
fn a_weight_behind_fused_rms_norm_is_a_named_error() {
    let (vocab, d) = (10, 8);
    let model = CandleModel::builder("fused", vocab, 4)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        // candle-nn's fused kernel: no backward pass to its weight.
        .stage("norm", move |vb, x| candle_nn::ops::rms_norm(x, &vb.get(d, "gain")?, 1e-5))
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
        .build()
        .unwrap();
    let params = init_params(&model, 1).unwrap();
    let err = full_forward_backward(&model, &params, &batch(vocab, 2, 4, 0)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("\"norm\"") && msg.contains("\"gain\"") && msg.contains("no gradient"), "{msg}");
    assert!(msg.contains("rms_norm"), "the message names the likely cause: {msg}");
}

#[test]
fn a_stage_input_without_gradient_is_a_named_error() {
    let (vocab, d) = (10, 8);
    let model = CandleModel::builder("cut", vocab, 4)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        // The weight has a gradient, the stage input none (detached).
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(&x.detach()))
        .build()
        .unwrap();
    let params = init_params(&model, 1).unwrap();
    let err = full_forward_backward(&model, &params, &batch(vocab, 2, 4, 0)).unwrap_err().to_string();
    assert!(err.contains("\"head\"") && err.contains("input received no gradient"), "{err}");
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
