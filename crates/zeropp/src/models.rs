//! The model of a `--model` value (the GPT and MLP presets and GPT shapes
//! here; `llama:...` is zeropp-run's [`LlamaShape`](zeropp_run::llama::LlamaShape)),
//! and the flag's help text.

use zeropp_engine::model::{GptConfig, MlpConfig};
use zeropp_run::train::ModelChoice;

use crate::CliError;

/// The model of a `--model` value: a preset name (`gpt-tiny`, `gpt`, `gpt-1m`,
/// ... `gpt2-small`, `mlp`, `mlp-tiny`), optionally followed by `:key=value,...`
/// overrides of a GPT's shape (`d`, `layers`, `heads`, `seq`, `mlp`), e.g.
/// `gpt:d=768,layers=12,heads=12,seq=256`. The shape is validated by the engine.
pub(crate) fn model_choice(spec: &str) -> Result<ModelChoice, CliError> {
    if let Some(llama) = ModelChoice::llama(spec).map_err(|e| format!("--model: {e}"))? {
        return Ok(llama);
    }
    let (name, keys) = match spec.split_once(':') {
        Some((n, k)) => (n.trim(), Some(k)),
        None => (spec.trim(), None),
    };
    let lower = name.to_ascii_lowercase();
    let base = match lower.as_str() {
        "gpt-small" => ModelChoice::Gpt(GptConfig::default_small()),
        "mlp" | "mlp-small" => ModelChoice::Mlp(MlpConfig::default_small()),
        "mlp-tiny" => ModelChoice::Mlp(MlpConfig::tiny()),
        other => match GptConfig::preset(other) {
            Some(g) => ModelChoice::Gpt(g),
            None => {
                let names: Vec<&str> = GptConfig::presets().iter().map(|(n, _)| *n).collect();
                return Err(format!(
                    "--model: unknown model `{other}` (expected {}, mlp or mlp-tiny)",
                    names.join(", ")
                )
                .into());
            }
        },
    };
    let Some(keys) = keys else { return Ok(base) };
    let ModelChoice::Gpt(mut g) = base else {
        return Err(format!(
            "--model: `{name}` takes no shape; only GPT models do (e.g. gpt:d=256,layers=4)"
        )
        .into());
    };
    for kv in keys.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(format!("--model: `{kv}` in `{spec}` is not key=value").into());
        };
        let (k, v) = (k.trim(), v.trim());
        let field = match k.to_ascii_lowercase().as_str() {
            "d" | "d_model" => &mut g.d_model,
            "layers" | "n_layer" => &mut g.n_layer,
            "heads" | "n_head" => &mut g.n_head,
            "seq" | "seq_len" => &mut g.seq_len,
            "mlp" | "mlp_ratio" => &mut g.mlp_ratio,
            _ => {
                return Err(format!(
                    "--model: unknown key `{k}` in `{spec}` (expected d, layers, heads, seq or mlp)"
                )
                .into());
            }
        };
        *field = v
            .parse::<usize>()
            .ok()
            .filter(|&x| x > 0)
            .ok_or_else(|| format!("--model: `{k}={v}` is not a positive integer"))?;
    }
    g.validate().map_err(|e| format!("--model `{spec}`: {e}"))?;
    Ok(ModelChoice::Gpt(g))
}

/// The `--model` help: the presets with their parameter counts (at a byte-level
/// vocabulary of 256; training takes the data's vocabulary).
pub(crate) fn model_help() -> String {
    let mut s = String::from(
        "Model: a preset, optionally with GPT shape overrides `NAME:d=768,layers=12,heads=12,seq=256[,mlp=4]`.\n\
         Presets (parameters at a byte vocabulary of 256; training uses the data's vocabulary):\n",
    );
    for (name, g) in GptConfig::presets() {
        s += &format!(
            "  {name:<11} d {:>3}, {:>2} layers, {:>2} heads, seq {:>4}: {:>6.2}M\n",
            g.d_model,
            g.n_layer,
            g.n_head,
            g.seq_len,
            g.with_vocab(256).num_params() as f64 / 1e6
        );
    }
    s += &zeropp_run::llama::help();
    s += "  mlp, mlp-tiny  context-window MLP language models\n\
          gpt2-small is GPT-2 small's shape; GPT-2's 124M counts a tied 50257-token embedding (38.6M).";
    s
}
