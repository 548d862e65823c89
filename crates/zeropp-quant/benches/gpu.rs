//! GPU throughput (feature `cuda`; run it with `cargo xtask bench gpu`).
//!
//! Each kernel's time is compared with a device-to-device `memcpy` of the same
//! number of input bytes, measured in the same run: `ratio = t_memcpy / t_kernel`
//! (above 1: faster than copying its input). Sizes are 4 MiB, 64 MiB and 1 GiB
//! of f32 input (the fused kernel's eight INT4 inputs hold as many bytes as the
//! f32 vector). Calls are timed as the API runs them: synchronous, with the
//! non-finite check read back, into preallocated outputs (`*_into`; one row
//! shows the allocating call); the memcpy is likewise synchronised each time,
//! enqueued on the same stream as the kernels (`async_copy_to` on
//! `Gpu::stream`), so the wait covers the copy itself, not only its launch.
//! Launch overhead is the time of a whole call on 256 elements.
//!
//! Writes markdown to `$ZEROPP_GPU_BENCH_OUT` (or stdout only). Without a device
//! it prints one skip line and exits 0, or fails under `ZEROPP_REQUIRE_GPU=1`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is a failed run

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use zeropp_quant::cuda::cust::memory::{AsyncCopyDestination, DeviceBuffer, DeviceCopy};
use zeropp_quant::cuda::{Gpu, GpuQuantized};
use zeropp_quant::half::bf16;
use zeropp_quant::{Options, QuantSpec};

const MIB: usize = 1 << 20;
const SIZES: &[(&str, usize)] = &[("4 MiB", 4 * MIB), ("64 MiB", 64 * MIB), ("1 GiB", 1024 * MIB)];

/// Mean seconds per call of `f`, over at least 5 calls and 0.2 s, after 2 warm-up calls.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    f();
    let start = Instant::now();
    let mut n = 0u32;
    while n < 5 || start.elapsed() < Duration::from_millis(200) {
        f();
        n += 1;
    }
    start.elapsed().as_secs_f64() / f64::from(n)
}

/// A device-to-device copy of `src` into `dst` on the kernels' stream, waited
/// for: the reference every kernel row is a ratio to. (A plain `copy_to` runs
/// on the legacy stream and returns before the copy ends, and waiting on
/// `gpu.stream()` then waits for nothing: it timed only the launch.)
fn copy_on_stream<T: DeviceCopy>(gpu: &Gpu, src: &DeviceBuffer<T>, dst: &mut DeviceBuffer<T>) {
    // SAFETY: both buffers are live and of equal length; the stream is
    // synchronized before either can be touched again.
    unsafe { src.async_copy_to(dst, gpu.stream()).unwrap() };
    gpu.stream().synchronize().unwrap();
}

fn fmt_t(s: f64) -> String {
    if s >= 1e-3 { format!("{:.3} ms", s * 1e3) } else { format!("{:.1} µs", s * 1e6) }
}

fn main() {
    let gpu = match Gpu::new() {
        Ok(g) => g,
        Err(e) => {
            if std::env::var("ZEROPP_REQUIRE_GPU").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true")) {
                eprintln!("gpu bench: ZEROPP_REQUIRE_GPU=1 but no usable CUDA device: {e}");
                std::process::exit(1);
            }
            eprintln!(
                "gpu bench: skipped: no usable CUDA device ({e}; set ZEROPP_REQUIRE_GPU=1 to make this a failure)"
            );
            return;
        }
    };
    let o = Options::default();
    let mut md = String::new();
    let _ = writeln!(md, "# bench `gpu`\n");
    let _ = writeln!(
        md,
        "Device: {}, driver API {}, kernels from the {}. Ratio = time of a device-to-device memcpy of the \
         kernel's input bytes / time of the kernel call, both measured in this run (synchronous calls).\n",
        gpu.device_name().unwrap_or_default(),
        gpu.driver_version().unwrap_or_default(),
        gpu.image()
    );

    // Launch overhead: whole calls on tiny inputs.
    let tiny: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let dt = gpu.upload(&tiny).unwrap();
    let mut ot = gpu.quantized_buffer(QuantSpec::int8(256).unwrap(), 256).unwrap();
    let t_call = time(|| gpu.quantize_into(&dt, &o, &mut ot).unwrap());
    let small = gpu.zeros(tiny.len()).unwrap();
    let mut small_dst = gpu.zeros(tiny.len()).unwrap();
    let t_copy = time(|| copy_on_stream(&gpu, &small, &mut small_dst));
    let _ = writeln!(
        md,
        "Per-call overhead: quantize_into of 256 elements {} (flag reset, launch, sync, non-finite read-back); \
         memcpy of 1 KiB {}.\n",
        fmt_t(t_call),
        fmt_t(t_copy)
    );

    let _ = writeln!(md, "| size | kernel | input bytes | time | GB/s (input) | ratio to memcpy |");
    let _ = writeln!(md, "|---|---|---|---|---|---|");
    for &(label, bytes) in SIZES {
        let n = bytes / 4;
        let x: Vec<f32> =
            (0..n).map(|i| ((i as u64 * 2_654_435_761 % 1_000_003) as f32 - 500_000.0) * 1e-5).collect();
        let dx = gpu.upload(&x).unwrap();
        let memcpy = |b: usize| {
            let src = gpu.zeroed_bytes(b).unwrap();
            let mut dst = gpu.zeroed_bytes(b).unwrap();
            time(|| copy_on_stream(&gpu, &src, &mut dst))
        };
        let t_f32 = memcpy(4 * n);
        let mut row = |name: &str, in_bytes: usize, t_ref: f64, t: f64| {
            let _ = writeln!(
                md,
                "| {label} | {name} | {in_bytes} | {} | {:.1} | {:.2}x |",
                fmt_t(t),
                in_bytes as f64 / t / 1e9,
                t_ref / t
            );
        };
        row("memcpy (device to device)", 4 * n, t_f32, t_f32);
        let int8 = QuantSpec::int8(2048).unwrap();
        let int4 = QuantSpec::int4(512).unwrap();
        let mut o8 = gpu.quantized_buffer(int8, n).unwrap();
        let mut o4 = gpu.quantized_buffer(int4, n).unwrap();
        row(
            "quantize f32 -> INT8 (allocating call)",
            4 * n,
            t_f32,
            time(|| drop(gpu.quantize(&dx, int8, &o).unwrap())),
        );
        row(
            "quantize f32 -> INT8 sym g2048",
            4 * n,
            t_f32,
            time(|| gpu.quantize_into(&dx, &o, &mut o8).unwrap()),
        );
        row(
            "quantize f32 -> INT4 sym g512",
            4 * n,
            t_f32,
            time(|| gpu.quantize_into(&dx, &o, &mut o4).unwrap()),
        );
        let so = o.stochastic(1);
        row(
            "quantize f32 -> INT4 stochastic",
            4 * n,
            t_f32,
            time(|| gpu.quantize_into(&dx, &so, &mut o4).unwrap()),
        );
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let dxb = gpu.upload(&xb).unwrap();
        drop(xb);
        let t_bf = memcpy(2 * n);
        row(
            "quantize bf16 -> INT8 sym g2048",
            2 * n,
            t_bf,
            time(|| gpu.quantize_into(&dxb, &o, &mut o8).unwrap()),
        );
        drop(dxb);
        // Dequantize: INT8 in (n bytes), f32 out.
        let q8 = gpu.quantize(&dx, int8, &o).unwrap();
        let mut out = gpu.zeros(n).unwrap();
        let t_q8 = memcpy(q8.encoded_len());
        row(
            "dequantize INT8 -> f32",
            q8.encoded_len(),
            t_q8,
            time(|| gpu.dequantize_into(&q8, &mut out).unwrap()),
        );
        row(
            "dequantize_add INT8 -> f32",
            q8.encoded_len(),
            t_q8,
            time(|| gpu.dequantize_add(&q8, &mut out).unwrap()),
        );
        drop((q8, out));
        // The fused qgZ kernel: k = 8 INT4 inputs -> INT4.
        let q4 = gpu.quantize(&dx, int4, &o).unwrap();
        let inputs: Vec<GpuQuantized> =
            (0..8).map(|_| gpu.upload_wire(&q4.to_bytes().unwrap()).unwrap()).collect();
        let refs: Vec<&GpuQuantized> = inputs.iter().collect();
        let in_bytes = 8 * q4.encoded_len();
        let t_in = memcpy(in_bytes);
        row(
            "dequant_reduce_quant k=8 INT4 -> INT4",
            in_bytes,
            t_in,
            time(|| gpu.dequant_reduce_quant_into(&refs, &o, &mut o4).unwrap()),
        );
    }
    print!("{md}");
    if let Ok(path) = std::env::var("ZEROPP_GPU_BENCH_OUT") {
        std::fs::write(&path, &md).unwrap();
    }
}
