//! `cargo xtask ptx [--check]`: compiles zeropp-quant's CUDA kernels into the
//! checked-in artefacts, and the stub `libcuda.so` for linking without a driver.
//!
//! No system CUDA is used. The toolchain is NVIDIA's wheels from PyPI, pinned,
//! in a venv under `target/cuda-venv`:
//!
//! - `nvidia-cuda-nvrtc-cu12`: NVRTC, the CUDA C++ front end as a library. The
//!   12.4-12.6 `nvidia-cuda-nvcc-cu12` wheels ship `ptxas` but no `nvcc`
//!   driver (nor `cicc`/`fatbinary`), so a 60-line C driver
//!   (`crates/zeropp-quant/cuda/nvrtcc.c`, built here with gcc) calls NVRTC.
//! - `nvidia-cuda-nvcc-cu12`: `ptxas`, which turns the PTX into sm_80 and sm_90
//!   cubins and reports registers and spills per kernel (a spill fails the task).
//!
//! Outputs (`crates/zeropp-quant/cuda/`): `zeropp_quant.ptx` (PTX ISA 8.4,
//! `compute_70`), `zeropp_quant.sm_80.cubin`, `zeropp_quant.sm_90.cubin`. The
//! `cuda` feature embeds all three and loads the cubin matching the device, else
//! the PTX. NVRTC and ptxas are deterministic (same bytes on every run, no
//! paths or dates inside), so `--check` regenerates into `target/cuda/check` and
//! compares bytes, as rust-analyzer's codegen tidy test does.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{root, run};

/// The pinned wheels. CUDA 12.4: its PTX (ISA 8.4) needs an R550+ driver, its
/// cubins should load on any R525+ (CUDA 12.0) driver.
const WHEELS: &[&str] = &["nvidia-cuda-nvrtc-cu12==12.4.127", "nvidia-cuda-nvcc-cu12==12.4.131"];
/// The NVRTC version line the pinned wheel prints.
const NVRTC_VERSION: &str = "nvrtc 12.4";
/// NVRTC options: PTX for compute_70 (Volta and newer can JIT it), no FMA
/// contraction (the kernels also spell every float op with an `_rn` intrinsic).
const NVRTC_OPTS: &[&str] = &["--gpu-architecture=compute_70", "--fmad=false", "--std=c++17"];
/// Architectures with a cubin (SASS) in the artefact.
pub(crate) const ARCHS: &[&str] = &["sm_80", "sm_90"];
/// The kernel source and the artefacts' stem, under `crates/zeropp-quant/cuda/`.
const STEM: &str = "zeropp_quant";

fn cuda_dir() -> PathBuf {
    root().join("crates/zeropp-quant/cuda")
}

/// The artefact file names, PTX first.
fn artefacts() -> Vec<String> {
    let mut v = vec![format!("{STEM}.ptx")];
    v.extend(ARCHS.iter().map(|a| format!("{STEM}.{a}.cubin")));
    v
}

/// `cargo xtask ptx [--check]`.
pub(crate) fn ptx(args: &[String]) -> Result<(), String> {
    let check = args.iter().any(|a| a == "--check");
    if let Some(bad) = args.iter().find(|a| *a != "--check") {
        return Err(format!("ptx: unknown argument `{bad}` (usage: cargo xtask ptx [--check])"));
    }
    let out = if check { root().join("target/cuda/check") } else { cuda_dir() };
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let report = build(&out)?;
    eprintln!("\n{report}");
    if !check {
        eprintln!("==> wrote {} in {}", artefacts().join(", "), out.display());
        return Ok(());
    }
    let mut stale = Vec::new();
    for name in artefacts() {
        let fresh = std::fs::read(out.join(&name)).map_err(|e| format!("{name}: {e}"))?;
        let committed = std::fs::read(cuda_dir().join(&name)).unwrap_or_default();
        if fresh != committed {
            stale.push(name);
        }
    }
    if stale.is_empty() {
        eprintln!("==> CUDA artefacts are current ({})", artefacts().join(", "));
        Ok(())
    } else {
        Err(format!(
            "stale CUDA artefacts in crates/zeropp-quant/cuda: {} (the kernels changed; run `cargo xtask ptx` and commit)",
            stale.join(", ")
        ))
    }
}

/// The venv's `site-packages/nvidia` folder, installing the pinned wheels first
/// if they are missing.
fn toolchain() -> Result<PathBuf, String> {
    let venv = root().join("target/cuda-venv");
    let pip = venv.join("bin/pip");
    let find = || -> Option<PathBuf> {
        let lib = std::fs::read_dir(venv.join("lib")).ok()?;
        lib.flatten().map(|e| e.path().join("site-packages/nvidia")).find(|p| {
            p.join("cuda_nvcc/bin/ptxas").is_file() && p.join("cuda_nvrtc/include/nvrtc.h").is_file()
        })
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    if !pip.is_file() {
        let mut c = Command::new("python3");
        c.args(["-m", "venv"]).arg(&venv);
        run("python venv for the CUDA wheels", c)?;
    }
    let mut c = Command::new(&pip);
    c.args(["install", "--quiet", "--disable-pip-version-check", "--no-cache-dir"]).args(WHEELS);
    run("pip install (pinned NVIDIA wheels)", c)?;
    find().ok_or_else(|| {
        format!("the wheels {WHEELS:?} did not install ptxas and nvrtc.h under {}", venv.display())
    })
}

/// Builds the NVRTC driver, the PTX and the cubins into `out`; returns the ptxas
/// report (a markdown table), or an error on any spill.
fn build(out: &Path) -> Result<String, String> {
    let nv = toolchain()?;
    let nvrtc_lib = nv.join("cuda_nvrtc/lib");
    let tool = root().join("target/cuda/nvrtcc");
    // `ptx` without `--check` writes into the source tree, so on a fresh
    // checkout nothing has made target/cuda yet.
    let tool_dir = root().join("target/cuda");
    std::fs::create_dir_all(&tool_dir).map_err(|e| format!("{}: {e}", tool_dir.display()))?;
    let mut gcc = Command::new("gcc");
    gcc.args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&tool)
        .arg(cuda_dir().join("nvrtcc.c"))
        .arg(format!("-I{}", nv.join("cuda_nvrtc/include").display()))
        .arg(format!("-L{}", nvrtc_lib.display()))
        .arg("-l:libnvrtc.so.12")
        .arg(format!("-Wl,-rpath,{}", nvrtc_lib.display()));
    run("gcc nvrtcc", gcc)?;

    let ptx = out.join(format!("{STEM}.ptx"));
    let mut c = Command::new(&tool);
    // Relative source path: the program name inside the PTX must not depend on the checkout.
    c.current_dir(cuda_dir()).arg(format!("{STEM}.cu")).arg(&ptx).args(NVRTC_OPTS);
    let o = c.output().map_err(|e| format!("nvrtcc: {e}"))?;
    let version = String::from_utf8_lossy(&o.stdout).trim().to_string();
    eprint!("{}", String::from_utf8_lossy(&o.stderr));
    if !o.status.success() {
        return Err(format!("nvrtcc failed ({})", o.status));
    }
    if version != NVRTC_VERSION {
        return Err(format!("expected {NVRTC_VERSION}, the venv has {version}"));
    }

    let ptxas = nv.join("cuda_nvcc/bin/ptxas");
    let mut rows = Vec::new();
    for arch in ARCHS {
        let cubin = out.join(format!("{STEM}.{arch}.cubin"));
        let o = Command::new(&ptxas)
            .args(["-arch", arch, "-O3", "-v", "--fmad=false", "--warn-on-spills"])
            .arg(&ptx)
            .arg("-o")
            .arg(&cubin)
            .output()
            .map_err(|e| format!("ptxas: {e}"))?;
        let log = String::from_utf8_lossy(&o.stderr).to_string();
        if !o.status.success() {
            return Err(format!("ptxas -arch {arch} failed ({}):\n{log}", o.status));
        }
        rows.extend(parse_ptxas(arch, &log));
    }
    rows.sort();
    let mut md = String::from(
        "ptxas (CUDA 12.4) per kernel:\n\n| kernel | arch | registers | spill stores | spill loads | stack |\n|---|---|---|---|---|---|\n",
    );
    let mut spills = Vec::new();
    for r in &rows {
        md.push_str(&format!("| {} | {} | {} | {} | {} | {} |\n", r.0, r.1, r.2, r.3, r.4, r.5));
        if r.3 > 0 || r.4 > 0 {
            spills.push(format!("{} ({})", r.0, r.1));
        }
    }
    if rows.is_empty() {
        return Err("ptxas reported no kernels".into());
    }
    if !spills.is_empty() {
        return Err(format!("{md}\nregister spills in: {}", spills.join(", ")));
    }
    Ok(md)
}

/// (kernel, arch, registers, spill stores, spill loads, stack bytes) per kernel.
type Row = (String, String, u32, u32, u32, u32);

fn parse_ptxas(arch: &str, log: &str) -> Vec<Row> {
    let num_before = |line: &str, word: &str| -> u32 {
        let Some(at) = line.find(word) else { return 0 };
        line[..at].split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or(0)
    };
    let mut rows: Vec<Row> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("?").to_string();
            rows.push((name, arch.to_string(), 0, 0, 0, 0));
        } else if let Some(r) = rows.last_mut() {
            if line.contains("spill stores") {
                r.5 = num_before(line, "bytes stack frame");
                r.3 = num_before(line, "bytes spill stores");
                r.4 = num_before(line, "bytes spill loads");
            } else if line.contains("registers") {
                r.2 = num_before(line, "registers");
            }
        }
    }
    rows
}

/// `cargo` with the link path for `-lcuda` set up.
pub(crate) fn cuda_cargo() -> Result<Command, String> {
    let stub = stub()?;
    let mut c = crate::cmd::cargo();
    if !has_driver() {
        // No driver: test binaries load the stub's libcuda.so.1 (cust::init then
        // reports NoDevice and the GPU tests skip). Cargo does not add the link
        // path to the loader's path itself (it is outside target/<profile>).
        let lib64 = stub.join("lib64");
        let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        let path =
            if old.is_empty() { lib64.display().to_string() } else { format!("{}:{old}", lib64.display()) };
        c.env("LD_LIBRARY_PATH", path);
    }
    c.env("CUDA_LIBRARY_PATH", stub);
    Ok(c)
}

/// Makes the stub driver library under `target/cuda-stub/lib64` for the link
/// step of `--features cuda` on machines without a driver, and returns the
/// value for `CUDA_LIBRARY_PATH` (read by `cust_raw`'s build script, which adds
/// `<dir>/lib64` to the link path).
///
/// The stub defines every `cu*` function `cust_raw` binds, each returning
/// `CUDA_ERROR_NO_DEVICE` (100): `cust::init` then fails and the GPU tests skip.
/// `libcuda.so` (the link name) is always written. `libcuda.so.1` (the run-time
/// name, the stub's soname) is only written when the machine has no real driver,
/// so that a loader path naming this folder can never hide a real driver.
pub(crate) fn stub() -> Result<PathBuf, String> {
    let base = root().join("target/cuda-stub");
    let lib64 = base.join("lib64");
    std::fs::create_dir_all(&lib64).map_err(|e| format!("{}: {e}", lib64.display()))?;
    let symbols = cust_raw_symbols()?;
    let mut c_src = String::from(
        "/* Generated by `cargo xtask`: a link-time stand-in for the CUDA driver.\n   \
         Every entry point returns CUDA_ERROR_NO_DEVICE. */\n",
    );
    // cust formats errors through these two, so they answer like a driver would.
    c_src.push_str(
        "static const char *no_device = \"CUDA_ERROR_NO_DEVICE: no CUDA driver, this is the link-time stub libcuda\";\n\
         int cuGetErrorString(int e, const char **s) { (void)e; *s = no_device; return 0; }\n\
         int cuGetErrorName(int e, const char **s) { (void)e; *s = \"CUDA_ERROR_NO_DEVICE\"; return 0; }\n",
    );
    for s in symbols.iter().filter(|s| !s.starts_with("cuGetError")) {
        c_src.push_str(&format!("int {s}(void) {{ return 100; }}\n"));
    }
    let c_file = base.join("libcuda_stub.c");
    std::fs::write(&c_file, c_src).map_err(|e| format!("{}: {e}", c_file.display()))?;
    let so = lib64.join("libcuda.so");
    let mut gcc = Command::new("gcc");
    gcc.args(["-shared", "-fPIC", "-O0", "-Wl,-soname,libcuda.so.1", "-o"]).arg(&so).arg(&c_file);
    let o = gcc.output().map_err(|e| format!("gcc: {e}"))?;
    if !o.status.success() {
        return Err(format!("gcc (libcuda stub) failed: {}", String::from_utf8_lossy(&o.stderr)));
    }
    let runtime = lib64.join("libcuda.so.1");
    let _ = std::fs::remove_file(&runtime);
    if !has_driver() {
        std::fs::copy(&so, &runtime).map_err(|e| format!("{}: {e}", runtime.display()))?;
    }
    Ok(base)
}

/// Whether the dynamic loader can find a real `libcuda.so.1`.
pub(crate) fn has_driver() -> bool {
    let ldconfig = ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"]
        .iter()
        .find_map(|l| Command::new(l).arg("-p").output().ok().filter(|o| o.status.success()));
    let listed = ldconfig.is_some_and(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so.1 "));
    let on_path = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .any(|d| !d.is_empty() && !d.contains("cuda-stub") && Path::new(d).join("libcuda.so.1").exists());
    let usual =
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/usr/local/nvidia/lib64"]
            .iter()
            .any(|d| Path::new(d).join("libcuda.so.1").exists());
    listed || on_path || usual
}

/// The names of the driver functions `cust_raw` declares (from its source, found
/// through `cargo metadata`).
fn cust_raw_symbols() -> Result<Vec<String>, String> {
    let o = crate::cmd::cargo()
        .args(["metadata", "--format-version", "1", "--locked", "--features", "zeropp-quant/cuda"])
        .output()
        .map_err(|e| format!("cargo metadata: {e}"))?;
    if !o.status.success() {
        return Err(format!("cargo metadata failed: {}", String::from_utf8_lossy(&o.stderr)));
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&o.stdout).map_err(|e| format!("cargo metadata: {e}"))?;
    let manifest = meta["packages"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "cust_raw"))
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or("cust_raw is not in the dependency graph (is the `cuda` feature's dependency gone?)")?;
    let src = Path::new(manifest).with_file_name("src/cuda.rs");
    let text = std::fs::read_to_string(&src).map_err(|e| format!("{}: {e}", src.display()))?;
    let mut names: Vec<String> = text
        .split("pub fn ")
        .skip(1)
        .filter_map(|s| s.split('(').next())
        .filter(|n| n.starts_with("cu") && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    if names.iter().any(|n| n == "cuInit") {
        Ok(names)
    } else {
        Err(format!("no cuInit in {}: cust_raw's layout changed", src.display()))
    }
}
