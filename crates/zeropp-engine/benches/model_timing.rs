//! Timing of one forward+backward of the default models, without the engine
//! or any communication: `cargo bench -p zeropp-engine --bench model_timing`.
//! Prints one line per model and rayon thread count (wall time, and CPU time of
//! the calling thread, which other load on the machine does not inflate).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark may unwrap

use std::time::Instant;

use zeropp_engine::model::{
    Batch, Gpt, GptConfig, Mlp, MlpConfig, Model, full_forward_backward, init_params,
};

fn batch(vocab: usize, b: usize, t: usize) -> Batch {
    let n = b * t;
    Batch {
        inputs: (0..n).map(|i| (i * 7 % vocab) as u32).collect(),
        targets: (0..n).map(|i| (i * 11 % vocab) as u32).collect(),
        batch: b,
        seq_len: t,
    }
}

/// CPU time of the calling thread (Linux), robust to other load on the machine.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

fn time<M: Model>(label: &str, model: &M, threads: usize) -> f64 {
    let params = init_params(model, 1).unwrap();
    let b = batch(model.vocab_size(), 8, model.seq_len());
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        for _ in 0..3 {
            full_forward_backward(model, &params, &b).unwrap();
        }
        let reps = 20;
        let cpu0 = thread_cpu_ns();
        let start = Instant::now();
        for _ in 0..reps {
            full_forward_backward(model, &params, &b).unwrap();
        }
        let ms = start.elapsed().as_secs_f64() * 1e3 / f64::from(reps);
        let cpu = thread_cpu_ns()
            .zip(cpu0)
            .map(|(b, a)| format!("{:.2} ms", (b - a) as f64 * 1e-6 / f64::from(reps)))
            .unwrap_or_else(|| "n/a".into());
        println!(
            "{label}: {ms:.2} ms wall ({cpu} CPU of this thread) per fwd+bwd of 8 x {} tokens on {threads} thread(s)",
            model.seq_len()
        );
        ms
    })
}

fn main() {
    let gpt = Gpt::new(GptConfig::default_small()).unwrap();
    println!("gpt default_small: {} parameters", gpt.num_params());
    let ms = time("gpt default_small", &gpt, 1);
    time("gpt default_small", &gpt, 2);
    let mlp = Mlp::new(MlpConfig::default_small()).unwrap();
    time("mlp default_small", &mlp, 1);
    if ms >= 1000.0 {
        eprintln!("warning: one fwd+bwd of gpt default_small took {ms:.0} ms (expected well under 1 s)");
    }
}
