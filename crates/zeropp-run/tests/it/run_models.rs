//! Every built-in model a run can name goes through one `train` and one
//! `compare`: the candle Llama is a [`ModelChoice`] like the native GPT and
//! MLP, and the run trains the model it names (its name and parameter count,
//! the Llama's checked against zeropp-candle's own count).

use zeropp_candle::LlamaConfig;
use zeropp_engine::config::ZeroConfig;
use zeropp_engine::data::load_data;
use zeropp_engine::{GptConfig, MlpConfig, Model};
use zeropp_run::compare::{Variant, compare};
use zeropp_run::train::{ModelChoice, TrainConfig, train};

/// A small Llama, as `--model` names it.
const SPEC: &str = "llama:d=16,layers=1,heads=2,kv_heads=1,seq=16";

/// The same Llama's parameter count over `vocab`, from zeropp-candle.
fn llama_params(vocab: usize) -> usize {
    LlamaConfig::shape(vocab, 16, 1, 2, 1, 16).num_params()
}

fn llama() -> ModelChoice {
    ModelChoice::llama(SPEC).unwrap().expect("the spec names the Llama")
}

#[test]
fn every_model_choice_trains_through_one_train() {
    let base = TrainConfig::tiny().with_steps(2);
    let vocab = load_data(&base.data).unwrap().0.vocab_size();
    let gpt_params = GptConfig::tiny().with_vocab(vocab).num_params();
    for (choice, name, params) in [
        (ModelChoice::Gpt(GptConfig::tiny()), "gpt", Some(gpt_params)),
        (ModelChoice::Mlp(MlpConfig::tiny()), "mlp", None),
        (llama(), "llama", Some(llama_params(vocab))),
    ] {
        let r = train(&TrainConfig { model: choice.clone(), ..base.clone() }).unwrap();
        assert_eq!(r.steps.len(), 2, "{name}");
        assert!(r.summary.final_loss.is_finite(), "{name}");
        let built = choice.build(vocab).unwrap();
        assert!(built.name().starts_with(name), "{name}: built {}", built.name());
        assert_eq!(r.summary.model, built.name(), "{name}");
        let numel: usize = built.layers().iter().map(|l| l.numel()).sum();
        assert_eq!(r.summary.params, params.unwrap_or(numel), "{name}");
    }
}

#[test]
fn compare_runs_the_model_it_is_given() {
    let base = TrainConfig { model: llama(), ..TrainConfig::tiny().with_steps(1) };
    let vocab = load_data(&base.data).unwrap().0.vocab_size();
    let variants = [
        Variant { name: "zero3".into(), zero: ZeroConfig::zero3() },
        Variant { name: "zeropp".into(), zero: ZeroConfig::zeropp(base.run.local_size) },
    ];
    let cmp = compare(&base, &variants, &mut |_, _| {}).unwrap();
    assert_eq!(cmp.results.len(), 2);
    for r in &cmp.results {
        assert_eq!(r.report.summary.model, "llama", "{}", r.variant.name);
        assert_eq!(r.report.summary.params, llama_params(vocab), "{}", r.variant.name);
    }
}

#[test]
fn a_bad_llama_spec_is_refused_with_its_reason() {
    let err = ModelChoice::llama("llama:heads=3").unwrap_err().to_string();
    assert!(err.contains("llama:heads=3") && err.contains("heads"), "{err}");
    assert!(ModelChoice::llama("gpt-tiny").unwrap().is_none());
}
