//! `cargo xtask test-torch` and `cargo xtask bench torch`: the `zeropp` Python
//! package (python/, crates/zeropp-py) against a pinned PyTorch.
//!
//! The venv lives outside the clone (`~/.cache/zeropp/torch-venv`, or
//! `ZEROPP_TORCH_VENV`), so CI on the same machine reuses it; a stamp file holds
//! the pins it was made with, and a venv with other pins is rebuilt. The package
//! is installed the way users install it: `cargo xtask dist` builds the
//! manylinux wheel, and the wheel goes into a fresh venv with no cargo or rustc
//! on PATH (`wheel.rs`; torch comes from the pinned venv). Then:
//!
//! 0. `python/tests/installed.py`: every module of the source tree is in the
//!    installed wheel and imports, one version, the import-time refusals; and
//!    the same check on a wheel with a module dropped, which must fail;
//! 1. `python/tests/test_kernels.py`: the kernels from Python are bit-identical to
//!    the Rust ones (reference vectors written by zeropp-quant's `golden_vectors`);
//! 2. `python/tests/dist_collectives.py` under torchrun, 4 processes as 2 nodes x 2
//!    (gloo): qgZ and qwZ within their analytic bounds, cross-node bytes <= 0.27x;
//! 3. `python/tests/parity.py`: FSDP2 training with and without zeropp.torch over
//!    3 seeds on tinyshakespeare, in the calm regime (lr 1e-3, 120 steps: the
//!    ratio's spread over seeds is 0.0005 there), mean validation-loss ratio
//!    <= 1.005;
//! 4. tests 2 and 3 again with seeded defects (python/tests/defects.py), which must
//!    fail: test 2 with `wrong-scale` and with `wrong-levels`, test 3 with
//!    `wrong-levels` (`wrong-scale` costs training less than any parity bound
//!    can see); and `python/tests/test_torch_kernels.py`: the device path's
//!    torch-op kernels equal the Rust kernels byte for byte;
//! 5. test 2 on the device path (`ZEROPP_TORCH_KERNELS=torch`) and on the floor
//!    release, torch 2.9.0 (`torch_floor.rs`); test 3 under HSDP (3b);
//!    5a. `python/tests/contract.py`: FSDP2's contract at a fault and at size
//!    (issue 37: a non-finite gradient on one rank, fp16 with GradScaler, no host
//!    synchronisation inside a collective, the state kept between steps, the
//!    refusals), on both kernel paths and on the floor release, and with three
//!    seeded defects that must fail it;
//! 6. `python/tests/plan_bytes.py` under torchrun (2 nodes x 2): the bytes of
//!    `zeropp plan --framework fsdp2` for two Hugging Face Llama shapes (and one
//!    of them on one node of 4) and
//!    every mode equal what `zeropp.torch.ByteCounter` counts on every rank;
//! 7. `python/bench/fidelity_size.py` under torchrun (2 nodes x 2), one step of
//!    a 99.5M-parameter HF Llama: qwZ's and qgZ's errors against the exact
//!    collectives inside bounds, and the seeded defect `qwz-int4` outside;
//! 8. `python/bench/hf_parity.py` under torchrun (2 nodes x 2), the loss
//!    curve's short version: the HF Llama's validation-loss ratio at 0.74M and
//!    1.66M parameters after 150 steps inside a two-sided bound, and the seeded
//!    defect `wrong-scale` outside.
//!
//! The main venv holds the latest torch release (2.15.0); the floor venv 2.9.0.
//!
//! Without a venv or Python, or without tinyshakespeare, the tests skip with one
//! line, except under `CI=true`, where they fail.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{cargo, in_ci, root, run};

/// The pinned versions: torch's PyPI wheel (the latest release; the floor,
/// 2.9.0, is `torch_floor.rs`'s), numpy and transformers. maturin is the dist tools'
/// (`dist.rs`); pyo3 is pinned in the workspace manifest.
/// transformers builds the Hugging Face Llama of `python/tests/plan_bytes.py`
/// and of `cargo xtask bench torch-scale`.
pub(crate) const PINS: &[&str] = &["torch==2.15.0", "numpy==2.2.6", TRANSFORMERS];

/// The transformers release the Llama tests and benches build with.
pub(crate) const TRANSFORMERS: &str = "transformers==5.25.0";

/// The venv: `ZEROPP_TORCH_VENV`, else `~/.cache/zeropp/torch-venv`.
fn venv_dir() -> PathBuf {
    if let Ok(v) = std::env::var("ZEROPP_TORCH_VENV") {
        return PathBuf::from(v);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    Path::new(&home).join(".cache/zeropp/torch-venv")
}

/// Starts [`ensure_venv`] on a thread, its pip output going to
/// `target/torch-venv.log`, so that `cargo xtask ci` installs torch (about 2
/// minutes on a new machine) while it builds and tests the Rust side; the
/// torch step joins it with [`VenvJob::wait`].
pub(crate) struct VenvJob(Option<std::thread::JoinHandle<Result<PathBuf, String>>>);

impl VenvJob {
    pub(crate) fn start() -> Self {
        let log = root().join("target/torch-venv.log");
        Self(Some(std::thread::spawn(move || {
            let _ = std::fs::create_dir_all(root().join("target"));
            let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
            eprintln!("==> torch venv: checking or installing in the background (log: {})", log.display());
            ensure_venv_logged(Some(&file))
        })))
    }

    /// Waits for the background install; its failure is only reported here
    /// (the torch step then tries again in the foreground, with its output).
    pub(crate) fn wait(mut self) {
        if let Some(h) = self.0.take() {
            match h.join() {
                Ok(Ok(v)) => eprintln!("\n==> torch venv ready: {}", v.display()),
                Ok(Err(e)) => eprintln!("\n==> torch venv: the background install failed ({e}); retrying"),
                Err(_) => eprintln!("\n==> torch venv: the background install panicked; retrying"),
            }
        }
    }
}

/// Creates the venv with the pinned packages unless its stamp says it has them.
fn ensure_venv() -> Result<PathBuf, String> {
    ensure_venv_logged(None)
}

/// [`ensure_venv`], with the commands' output into `log` when given.
fn ensure_venv_logged(log: Option<&std::fs::File>) -> Result<PathBuf, String> {
    let quiet = |step: &str, mut c: Command| -> Result<(), String> {
        let Some(f) = log else { return run(step, c) };
        let (out, err) = (f.try_clone(), f.try_clone());
        let (Ok(out), Ok(err)) = (out, err) else { return run(step, c) };
        let status = c.stdout(out).stderr(err).status().map_err(|e| format!("{step}: {e}"))?;
        if status.success() { Ok(()) } else { Err(format!("{step} failed ({status})")) }
    };
    let venv = venv_dir();
    let stamp = venv.join("zeropp-pins.txt");
    let want = PINS.join("\n");
    let python = venv.join("bin/python");
    if python.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(venv);
    }
    if !python.is_file() {
        if let Some(parent) = venv.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        let mut c = Command::new("python3");
        c.args(["-m", "venv"]).arg(&venv);
        quiet("python venv for torch (outside the clone, reused across runs)", c)?;
    }
    let mut c = Command::new(venv.join("bin/pip"));
    c.args(["install", "--quiet", "--disable-pip-version-check"]).args(PINS);
    quiet("pip install (pinned torch, numpy; ~7 GB with torch's CUDA wheels)", c)?;
    std::fs::write(&stamp, want).map_err(|e| format!("{}: {e}", stamp.display()))?;
    Ok(venv)
}

/// A free localhost TCP port for torchrun's rendezvous.
fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// `script` under torchrun, 4 processes as 2 nodes x 2, with the seeded defect
/// `defect` (a name of python/tests/defects.py) or none.
pub(crate) fn torchrun(
    venv: &Path,
    script: &str,
    args: &[&str],
    defect: Option<&str>,
) -> Result<Command, String> {
    // A hang (a collective some rank never joins, as mismatched sub-groups
    // give) must fail the step, not sit until CI's limit: 20 minutes is several
    // times the slowest test here.
    torchrun_within(venv, script, args, defect, 1200)
}

/// [`torchrun`] killed after `seconds` (the benches' long training runs).
pub(crate) fn torchrun_within(
    venv: &Path,
    script: &str,
    args: &[&str],
    defect: Option<&str>,
    seconds: u32,
) -> Result<Command, String> {
    let mut c = Command::new("timeout");
    crate::wheel::without_rust(&mut c)?;
    c.args(["--kill-after=10", &seconds.to_string()])
        .arg(venv.join("bin/python"))
        .args(["-m", "torch.distributed.run", "--nproc-per-node", "4", "--local-ranks-filter", "0"])
        .arg(format!("--master-port={}", free_port()?))
        .arg(root().join(script))
        .args(args)
        .current_dir(root().join("target"))
        .env("ZEROPP_LOCAL_SIZE", "2")
        .env("OMP_NUM_THREADS", "1")
        .env("ZEROPP_SHAKESPEARE", shakespeare());
    match defect {
        Some(name) => c.env("ZEROPP_SEEDED_DEFECT", name),
        None => c.env_remove("ZEROPP_SEEDED_DEFECT"),
    };
    // The kernels are the test's choice (`on_device_path`), not the caller's shell's.
    c.env_remove("ZEROPP_TORCH_KERNELS");
    Ok(c)
}

/// (hidden, layers, heads, key/value heads, SwiGLU width, vocabulary): about
/// 0.9M, 5.0M, 25.6M and 99.5M parameters (the last is `bench torch-scale`'s): `bench fidelity-size`'s widths,
/// whose largest test 7 checks.
pub(crate) const FIDELITY_SIZES: [(usize, usize, usize, usize, usize, usize); 4] = [
    (128, 2, 2, 2, 344, 2048),
    (256, 4, 4, 2, 688, 4096),
    (512, 6, 8, 4, 1376, 8000),
    (768, 8, 12, 4, 2048, 32000),
];

/// `fidelity_size.py`'s flags for the width `size` (without `--out`).
pub(crate) fn fidelity_size_args(size: (usize, usize, usize, usize, usize, usize)) -> Vec<String> {
    let (h, l, heads, kv, ff, vocab) = size;
    let mut a = Vec::new();
    for (flag, v) in [
        ("--hidden", h),
        ("--layers", l),
        ("--heads", heads),
        ("--kv-heads", kv),
        ("--ff", ff),
        ("--vocab", vocab),
    ] {
        a.push(flag.to_string());
        a.push(v.to_string());
    }
    a
}

/// Test 7: qwZ's and qgZ's errors against the exact collectives of the same
/// inputs, one step of the largest width of `bench fidelity-size` (99.5M
/// parameters), every layer kind inside bounds set from that bench's curve
/// (relative error of the weights 0.004-0.015, INT8 measures 0.0073 at every
/// width; of the gradients 0.06-0.35, INT4 measures 0.10-0.13 with the default
/// rotation, 0.10-0.23 unrotated); INT4 weights
/// in qwZ (the seeded defect `qwz-int4`, 0.11) must fail it.
fn test7(venv: &Path) -> Result<(), String> {
    let size = FIDELITY_SIZES[FIDELITY_SIZES.len() - 1];
    let out = root().join("target/fidelity-size-test.json");
    let mut args = fidelity_size_args(size);
    args.extend(
        [
            "--steps",
            "1",
            "--probe",
            "1",
            "--weight-bounds",
            "0.004,0.015",
            "--grad-bounds",
            "0.06,0.35",
            "--out",
        ]
        .map(String::from),
    );
    args.push(out.display().to_string());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    run(
        "test 7: qwZ and qgZ against the exact collectives, 99.5M parameters, one step",
        torchrun(venv, "python/bench/fidelity_size.py", &refs, None)?,
    )?;
    must_fail(
        "test 7 with the seeded defect qwz-int4 (INT4 weights in qwZ)",
        torchrun(venv, "python/bench/fidelity_size.py", &refs, Some("qwz-int4"))?,
        // The weights' check, not another one, must be what fails.
        "FAIL weight",
    )
}

/// Test 8, the loss curve's short version (`bench fidelity-size`'s loss
/// part): zeropp.torch's validation loss over FSDP2's on the HF Llama at that
/// curve's two smallest widths (0.74M and 1.66M parameters), 150 steps of
/// tinyshakespeare, seed 1, inside a two-sided bound set from 4 seeds of the
/// same runs ([`TEST8_BOUNDS`]); encodings read with their neighbour's scales
/// (the seeded defect `wrong-scale`) must fail it at the smallest width.
fn test8(venv: &Path) -> Result<(), String> {
    let data = shakespeare().display().to_string();
    let (lo, hi) = (TEST8_BOUNDS.0.to_string(), TEST8_BOUNDS.1.to_string());
    let args = |d: &'static str| -> Vec<String> {
        [
            "--data",
            &data,
            "--seeds",
            "1",
            "--steps",
            "150",
            "--hidden",
            d,
            "--layers",
            "4",
            "--heads",
            "4",
            "--marks",
            "1",
            "--min-mean",
            &lo,
            "--max-mean",
            &hi,
            "--max-worst",
            &hi,
        ]
        .map(String::from)
        .to_vec()
    };
    for (d, params) in [("128", "0.74M"), ("192", "1.66M")] {
        let a = args(d);
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        run(
            &format!("test 8: validation loss / FSDP2's, HF Llama {params}, 150 steps, within {lo}-{hi}"),
            torchrun(venv, "python/bench/hf_parity.py", &refs, None)?,
        )?;
    }
    let a = args("128");
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    must_fail(
        "test 8 with the seeded defect wrong-scale (each group read with its neighbour's scale)",
        torchrun(venv, "python/bench/hf_parity.py", &refs, Some("wrong-scale"))?,
        ": FAIL",
    )
}

/// Test 8's bound on one seed's ratio. With qgZ unrotated, over seeds 1-4 of
/// its runs the ratio is 0.9932-1.0032 at 0.74M and 1.0023-1.0103 at 1.66M (sd
/// 0.0043 and 0.0033); with the default rotation (the down projections) seeds
/// 1-2 give 1.0035, 1.0012 and 1.0025, 1.0030, so each side is at least three
/// standard deviations from seed 1 (1.0035 and 1.0025). `wrong-scale` scores
/// 1.0401 at 0.74M. INT4 weights in qwZ (1.0103) cost less than one seed can
/// resolve here: test 7 sees them. With every group rotated
/// (`qgz_hadamard=True`) seeds 1-4 give 0.9954-1.0048 and 1.0028-1.0074,
/// inside the same bound.
const TEST8_BOUNDS: (f64, f64) = (0.985, 1.02);

/// `cmd` with the device path's torch-op kernels forced on CPU tensors.
fn on_device_path(mut cmd: Command) -> Command {
    cmd.env("ZEROPP_TORCH_KERNELS", "torch");
    cmd
}

/// tinyshakespeare: `ZEROPP_SHAKESPEARE` when set (the release workflow
/// fetches its own copy), else `shared/data` beside the checkout.
fn shakespeare() -> PathBuf {
    std::env::var_os("ZEROPP_SHAKESPEARE")
        .map_or_else(|| root().join("../shared/data/tinyshakespeare.txt"), PathBuf::from)
}

/// Runs `cmd`, which must fail the way a test fails on a seeded defect: exit
/// status 1 and a check's verdict in the output (`verdict`: a line starting
/// with `FAIL ` from the collective checks, `: FAIL` from the parity summary).
/// A pass is an error, and so is any other failure (a crash, an import error,
/// the timeout): the check would then not have seen the defect.
fn must_fail(step: &str, mut cmd: Command, verdict: &str) -> Result<(), String> {
    eprintln!("\n==> {step} (must fail): {cmd:?}");
    let out = cmd.output().map_err(|e| format!("{step}: could not start: {e}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let seen = seeded_failure(out.status.code(), &text, verdict);
    if !seen {
        eprintln!("{}", tail_lines(&text, 30));
    }
    match (out.status.success(), seen) {
        (true, _) => Err(format!("{step}: passed with a seeded defect; the check cannot catch it")),
        (false, false) => Err(format!(
            "{step}: failed ({}) without the check's verdict `{verdict}`: a crash is not the defect being caught",
            out.status
        )),
        (false, true) => {
            eprintln!("==> {step}: failed on its check, as it must ({})", out.status);
            Ok(())
        }
    }
}

/// Whether a run ended as a test that caught its defect: exit 1 and `verdict`
/// at the start of a line (`FAIL `) or inside one (`: FAIL`).
fn seeded_failure(code: Option<i32>, output: &str, verdict: &str) -> bool {
    code == Some(1)
        && output
            .lines()
            .any(|l| if verdict.starts_with(':') { l.contains(verdict) } else { l.starts_with(verdict) })
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The venvs of a torch run: the pinned torch (`base`), the wheel that was
/// built (`wheel`), and the fresh venv that holds it beside `base`'s packages
/// (`venv`, where every test runs).
pub(crate) struct Prepared {
    pub(crate) base: PathBuf,
    pub(crate) wheel: PathBuf,
    pub(crate) venv: PathBuf,
}

/// Installs the pinned venv, builds the wheel and installs it into a fresh
/// venv; `None` when skipped outside CI.
fn prepare_wheel(given: Option<&Path>) -> Result<Option<Prepared>, String> {
    let base = match ensure_venv() {
        Ok(v) => v,
        Err(e) if !in_ci() => {
            eprintln!("SKIP test-torch: no usable torch venv ({e}); CI=true makes this an error");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let wheel = match given {
        // Absolute: pip and installed.py run from target/, not from here.
        Some(w) if w.is_file() => {
            std::path::absolute(w).map_err(|e| format!("--wheel {}: {e}", w.display()))?
        }
        Some(w) => return Err(format!("--wheel {}: no such file", w.display())),
        None => match crate::dist::build_wheel(None) {
            Ok(w) => w,
            Err(e) if !in_ci() => {
                eprintln!("SKIP test-torch: the wheel could not be built ({e}); CI=true makes this an error");
                return Ok(None);
            }
            Err(e) => return Err(e),
        },
    };
    let venv = crate::wheel::install(&root().join("target/wheel-venv"), &base, &wheel)?;
    Ok(Some(Prepared { base, wheel, venv }))
}

/// The venv with the wheel installed (for the benches); `None` when skipped
/// outside CI.
pub(crate) fn prepare() -> Result<Option<PathBuf>, String> {
    Ok(prepare_wheel(None)?.map(|p| p.venv))
}

/// `cargo xtask test-torch [--wheel PATH]`: the tests from the wheel at PATH
/// (a release's artifact), or from one `dist` builds now.
pub(crate) fn test(args: &[String]) -> Result<(), String> {
    let given = match args {
        [] => None,
        [flag, path] if flag == "--wheel" => Some(PathBuf::from(path)),
        other => return Err(format!("test-torch: unknown arguments {other:?} (use --wheel PATH)")),
    };
    let Some(Prepared { base, wheel, venv }) = prepare_wheel(given.as_deref())? else { return Ok(()) };
    // 0. The installed wheel is the source tree's package, and a wheel that
    //    lacks one of its modules fails the check on that module.
    run(
        "test 0: the installed wheel (python/tests/installed.py)",
        crate::wheel::check_command(&venv, &wheel)?,
    )?;
    let dropped = crate::wheel::without_member(
        &wheel,
        "zeropp/torch/allreduce.py",
        &root().join("target/dist-defect"),
    )?;
    let defect_venv = crate::wheel::install(&root().join("target/wheel-defect-venv"), &base, &dropped)?;
    must_fail(
        "test 0 with the seeded defect: a wheel without zeropp/torch/allreduce.py",
        crate::wheel::check_command(&defect_venv, &dropped)?,
        // The module check itself, not any failure the missing module causes.
        "FAIL module zeropp.torch.allreduce is in the wheel",
    )?;

    let out = root().join("target/torch");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;

    // 1. Bit-identical kernels.
    let golden = out.join("golden");
    // Built in the tests' profile with the workspace's features: under `ci` the
    // workspace's tests built this example already (a release build of it took
    // 36 s of CI).
    let mut b = cargo();
    b.args(["build", "--locked", "-q", "--profile", "test", "--workspace", "--example", "golden_vectors"]);
    run("build the reference-vector writer", b)?;
    // The CLI for test 6, as CI's MPI steps built it (any other set of targets or
    // features resolves the dependencies' features differently and rebuilds the
    // stack: 101 s of CI with `--bin zeropp` alone).
    let z = if crate::cmd::has_mpirun() {
        crate::cmd::mpi_suite_build("test")
    } else {
        let mut z = cargo();
        z.args(["build", "--locked", "--profile", "test", "--workspace", "--bin", "zeropp"]);
        z
    };
    run("build the CLI (zeropp plan, for test 6)", z)?;
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from);
    let mut g = Command::new(target.join("debug/examples/golden_vectors"));
    g.arg(&golden);
    run("reference vectors from the Rust kernels", g)?;
    // Run as a script from target/, so `import zeropp` finds the installed package,
    // not the source folder python/zeropp (which has no extension module).
    let mut t1 = Command::new(venv.join("bin/python"));
    crate::wheel::without_rust(&mut t1)?;
    t1.arg(root().join("python/tests/test_kernels.py"))
        .arg("-v")
        .current_dir(root().join("target"))
        .env("ZEROPP_GOLDEN", &golden);
    run("test 1: kernels from Python == Rust", t1)?;
    let mut t4 = Command::new(venv.join("bin/python"));
    crate::wheel::without_rust(&mut t4)?;
    t4.arg(root().join("python/tests/test_torch_kernels.py")).arg("-v").current_dir(root().join("target"));
    run("test 4: the device path's torch-op kernels == the Rust kernels (bitwise, nearest rounding)", t4)?;

    // The guide's recipe as a user pastes it; a wrong keyword in it must fail.
    doc_recipe(&venv)?;

    // 2. Collectives on a 2 x 2 gloo group; 4. with the seeded defect.
    run(
        "test 2: collectives under torchrun (2 nodes x 2)",
        torchrun(&venv, "python/tests/dist_collectives.py", &[], None)?,
    )?;
    // 6. `zeropp plan --framework fsdp2`'s bytes are what ByteCounter counts in a
    // real run: two HF Llama shapes on 2 x 2 and one on a node of 4, every mode, to the byte.
    let cli = target.join("debug/zeropp").display().to_string();
    run(
        "test 6: zeropp plan --framework fsdp2's bytes == ByteCounter's (HF Llama, 3 jobs x 3 modes)",
        torchrun(&venv, "python/tests/plan_bytes.py", &[&cli], None)?,
    )?;
    test7(&venv)?;
    for defect in ["wrong-scale", "wrong-levels"] {
        must_fail(
            &format!("test 4a: collectives with the seeded defect {defect}"),
            torchrun(&venv, "python/tests/dist_collectives.py", &[], Some(defect))?,
            "FAIL ",
        )?;
    }
    // FSDP2's contract at a fault (issue 37: a non-finite gradient, fp16 with
    // GradScaler, no host sync, the state kept between steps, refusals), on both
    // kernel paths; each seeded defect must fail its test.
    run("test 5a: FSDP2's contract (Rust kernels)", torchrun(&venv, "python/tests/contract.py", &[], None)?)?;
    run(
        "test 5a, device path: FSDP2's contract with ZEROPP_TORCH_KERNELS=torch",
        on_device_path(torchrun(&venv, "python/tests/contract.py", &[], None)?),
    )?;
    // Each defect must fail on its own check (the verdict's text), not on any.
    for (defect, tests, verdict) in [
        ("nonfinite-raises", "1,2", "FAIL "),
        ("host-sync", "3", "FAIL "),
        ("index-plan", "4", "FAIL "),
        ("rotation-spans-rows", "6", "FAIL test 6: the embedding's unseen rows"),
        ("rotation-whole-rows", "6", "FAIL test 6: qgZ's rotation at width 256"),
        ("rotation-wrong-inverse", "6", "FAIL test 6b: blocks.0.out.weight, rotated"),
        ("auto-rank-local", "6", "FAIL test 6c: the parameters the automatic rotation chose"),
        ("auto-device-flags-ignored", "6", "FAIL test 6c: auto, on the device"),
    ] {
        let mut c = torchrun(&venv, "python/tests/contract.py", &[], Some(defect))?;
        c.env("ZEROPP_CONTRACT_TESTS", tests);
        must_fail(&format!("test 5a with the seeded defect {defect} (tests {tests})"), c, verdict)?;
    }
    // The floor: tests 2 and 5a on the oldest torch with FSDP2's custom collectives.
    let floor = crate::torch_floor::venv(&base, &wheel)?;
    run(
        &format!("test 2 on the floor release ({})", crate::torch_floor::FLOOR),
        torchrun(&floor, "python/tests/dist_collectives.py", &[], None)?,
    )?;
    run(
        &format!("test 5a on the floor release ({})", crate::torch_floor::FLOOR),
        torchrun(&floor, "python/tests/contract.py", &[], None)?,
    )?;
    // The same checks on the device path (torch ops on CPU tensors).
    run(
        "test 2, device path: collectives with ZEROPP_TORCH_KERNELS=torch",
        on_device_path(torchrun(&venv, "python/tests/dist_collectives.py", &[], None)?),
    )?;
    must_fail(
        "test 4a, device path: collectives with the seeded defect wrong-levels",
        on_device_path(torchrun(&venv, "python/tests/dist_collectives.py", &[], Some("wrong-levels"))?),
        "FAIL ",
    )?;

    // 3. Training parity; 4. with the seeded defect.
    if !shakespeare().is_file() {
        let msg = format!("{} is absent: the training-parity test (3) needs it", shakespeare().display());
        if in_ci() {
            return Err(msg);
        }
        eprintln!("SKIP test 3 and 4b: {msg}");
        return Ok(());
    }
    // Three seeds: at a spread of 0.0005 they bound the mean as five did, and
    // test 8 trains the HF Llama beside it.
    let seeds = std::env::var("ZEROPP_TORCH_SEEDS").unwrap_or_else(|_| "3".into());
    let steps = std::env::var("ZEROPP_TORCH_STEPS").unwrap_or_else(|_| "120".into());
    let json = out.join("parity.json");
    let json_s = json.display().to_string();
    // The calm regime: at lr 1e-3 and 120 steps the loss falls smoothly on every
    // seed, the ratio is 1.0028 with a spread (sd) of 0.0005 over 5 seeds (CI runs 3;
    // 1.0029 and 0.0004 with qgZ's rotation), so 1.005 is a tight bound that still
    // holds on other CPUs; `wrong-levels` scores 1.016.
    // At lr 3e-3 a 100-200-step run is in the loss plateau, where a seed's ratio
    // swings from 0.87 to 1.10 with or without a defect. The 1.01 goal is measured
    // over 5 seeds x 1000 steps at 3e-3 (docs/PERFORMANCE.md, "PyTorch FSDP2").
    let max_mean = std::env::var("ZEROPP_TORCH_MAX_MEAN").unwrap_or_else(|_| "1.005".into());
    let args = parity_args(&seeds, &steps, &max_mean, &["--out", &json_s]);
    run(
        "test 3: FSDP2 training parity (zeropp / default)",
        torchrun(&venv, "python/tests/parity.py", &args, None)?,
    )?;
    // HSDP 2 x 2 (a replica per node): the default's native mesh against zeropp's
    // take-over of the replica all-reduce (1.0022 on seed 1 here).
    let hsdp_json = out.join("parity-hsdp.json").display().to_string();
    let hsdp_seeds = std::env::var("ZEROPP_TORCH_HSDP_SEEDS").unwrap_or_else(|_| "3".into());
    let hsdp_args = parity_args(&hsdp_seeds, &steps, &max_mean, &["--hsdp", "--out", &hsdp_json]);
    run(
        "test 3b: HSDP 2 x 2 training parity (zeropp's all-reduce take-over / native HSDP)",
        torchrun(&venv, "python/tests/parity.py", &hsdp_args, None)?,
    )?;
    must_fail(
        "test 4b: training parity with the seeded defect wrong-levels",
        torchrun(
            &venv,
            "python/tests/parity.py",
            &parity_args("1", &steps, &max_mean, &[]),
            Some("wrong-levels"),
        )?,
        ": FAIL",
    )?;
    test8(&venv)?;
    eprintln!("\ntest-torch: all green (parity figures in {})", json.display());
    Ok(())
}

/// The recipe of `docs/pytorch.md` (the first ```` ```python ```` block under
/// "## The recipe"), run as a user pastes it: under torchrun as 2 nodes x 2,
/// it must finish and print its summary line. The same script with an
/// `enable()` keyword that does not exist must then fail on that keyword, so
/// the step can see a guide that drifts from the API.
fn doc_recipe(venv: &Path) -> Result<(), String> {
    let guide = root().join("docs/pytorch.md");
    let text = std::fs::read_to_string(&guide).map_err(|e| format!("{}: {e}", guide.display()))?;
    let script = recipe_block(&text).ok_or("docs/pytorch.md: no ```python block under \"## The recipe\"")?;
    let call = "zt.enable(model, local_size=local)";
    if !script.contains(call) {
        return Err(format!(
            "docs/pytorch.md's recipe no longer calls `{call}`: update the seeded defect here"
        ));
    }
    let dir = root().join("target/doc-recipe");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (good, bad) = (dir.join("train.py"), dir.join("train_wrong_keyword.py"));
    let wrong = script.replace(call, "zt.enable(model, local_size=local, not_an_option=True)");
    for (path, body) in [(&good, &script), (&bad, &wrong)] {
        std::fs::write(path, body).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let step = "docs/pytorch.md's recipe under torchrun (2 nodes x 2)";
    let mut c = torchrun(venv, &good.display().to_string(), &[], None)?;
    eprintln!("\n==> {step}: {c:?}");
    let out = c.output().map_err(|e| format!("{step}: could not start: {e}"))?;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{}", tail_lines(&said, 8));
    if !out.status.success() || !said.contains("FSDP2 modules, world 4") {
        return Err(format!("{step}: {} without its summary line", out.status));
    }
    must_fail(
        "docs/pytorch.md's recipe with a keyword enable() does not take",
        torchrun(venv, &bad.display().to_string(), &[], None)?,
        ": TypeError: enable() got an unexpected keyword argument 'not_an_option'",
    )
}

/// The first ```` ```python ```` block after the line `## The recipe`.
fn recipe_block(guide: &str) -> Option<String> {
    let after = &guide[guide.find("\n## The recipe\n")?..];
    let start = after.find("```python\n")? + "```python\n".len();
    let len = after[start..].find("\n```")?;
    Some(after[start..start + len + 1].to_string())
}

/// `parity.py`'s arguments: `seeds` seeds of `steps` steps at lr 1e-3,
/// failing where the mean ratio to FSDP2 passes `max_mean`, then `extra`.
fn parity_args<'a>(seeds: &'a str, steps: &'a str, max_mean: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["--seeds", seeds, "--steps", steps, "--lr", "1e-3", "--max-mean", max_mean];
    a.extend_from_slice(extra);
    a
}

#[cfg(test)]
mod tests {
    use super::seeded_failure;

    /// Only exit 1 with the check's verdict counts as the seeded defect caught:
    /// a pass, a crash (an import error, a signal, the timeout) does not.
    #[test]
    fn only_the_checks_own_failure_counts() {
        let verdict = "ok   a\nFAIL qgZ reduce-scatter within the bound\n";
        assert!(seeded_failure(Some(1), verdict, "FAIL "));
        assert!(!seeded_failure(Some(0), verdict, "FAIL "));
        assert!(!seeded_failure(Some(124), verdict, "FAIL "), "the timeout");
        assert!(!seeded_failure(None, verdict, "FAIL "), "a signal");
        let crash = "ModuleNotFoundError: No module named 'zeropp'\nFAILED (errors=1)\n";
        assert!(!seeded_failure(Some(1), crash, "FAIL "));
        let parity = "parity: mean ratio 1.0160 ... over 1 seeds: FAIL (bound 1.005)\n";
        assert!(seeded_failure(Some(1), parity, ": FAIL"));
        assert!(!seeded_failure(Some(1), "Traceback: RuntimeError\n", ": FAIL"));
    }
}
