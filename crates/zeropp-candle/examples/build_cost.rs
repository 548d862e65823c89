//! What `CandleModel::build()` costs, its gradient check included: wall time
//! and peak resident memory of building one candle Llama, against the model's
//! size and its largest stage's (issue 38 §1; `cargo xtask bench candle-build`
//! runs it at three sizes, one process each, so each peak is the build's own).
//!
//! ```text
//! cargo run --release -p zeropp-candle --example build_cost -- 1024 8 16 4 128
//! ```
//!
//! Arguments: d, layers, heads, key/value heads, sequence length (vocabulary
//! 256, the CLI's). Prints one JSON object: parameters, the f32 model's bytes,
//! the largest stage's f32 bytes, the build's seconds, and its peak resident
//! bytes above the process's resident size before it (`VmHWM` after
//! `/proc/self/clear_refs`, Linux).

use std::time::Instant;

use zeropp_candle::LlamaConfig;
use zeropp_engine::Model;

/// A line of `/proc/self/status` in bytes (`VmRSS`, `VmHWM`), 0 elsewhere.
fn status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> =
        std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>().map_err(|e| format!("{e}"))?;
    let [d, layers, heads, kv, seq] = args[..] else {
        return Err("usage: build_cost D LAYERS HEADS KV_HEADS SEQ".into());
    };
    // Like the CLI: keep freed memory in the process (candle allocates per op).
    zeropp_candle::alloc::retain_freed_memory();
    let c = LlamaConfig::shape(256, d, layers, heads, kv, seq);
    // The resident peak from here on (Linux: 5 resets VmHWM to VmRSS).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = status_bytes("VmRSS:");
    let t0 = Instant::now();
    let model = c.build()?;
    let secs = t0.elapsed().as_secs_f64();
    let peak = status_bytes("VmHWM:").saturating_sub(before);
    let largest: usize =
        model.layers().iter().map(|l| l.params.iter().map(|p| p.numel()).sum::<usize>()).max().unwrap_or(0);
    println!(
        "{{\"d\": {d}, \"layers\": {layers}, \"params\": {}, \"model_f32_bytes\": {}, \"largest_stage_f32_bytes\": {}, \
         \"build_s\": {secs:.3}, \"build_peak_bytes\": {peak}, \"notes\": {}}}",
        c.num_params(),
        4 * c.num_params(),
        4 * largest,
        model.gradient_check_notes().len()
    );
    Ok(())
}
