//! The crates as a registry user gets them: `cargo xtask package-check` (run
//! by `ci`) and `cargo xtask publish` (run by the release workflow).
//!
//! `package-check` packs every published crate (`cargo package`, the tarball
//! a registry would serve: the normalized manifest, only the packaged files,
//! no path dependencies), unpacks the tarballs into `target/package-check`,
//! and there, in a workspace of the unpacked crates alone whose
//! `[patch.crates-io]` points each crate's version dependency at its sibling
//! tarball (what a local registry does), it
//!
//! 1. runs every library crate's doc tests (the crate-level README's examples
//!    among them),
//! 2. checks the CLI (`cargo check`: a linked `zeropp` would replace the
//!    workspace's own binary),
//! 3. builds and runs `tests/registry-user`, a crate that depends on
//!    `zeropp-quant` and `zeropp-comm` by version only and checks a qwZ
//!    all-gather on threads against zeropp-quant's own round trip.
//!
//! It shares the workspace's target folder, build profiles and (with
//! zeropp-py unpacked beside them, [`PACKED_TOO`]) feature sets, so the
//! registry dependencies built by the tests are reused and only the unpacked
//! crates compile again (`cargo package --workspace`'s own verification would
//! build every dependency again, per crate, without the workspace's profiles).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{cargo, root, run};

/// The published crates, in stack order: each depends only on crates before
/// it. `cargo publish --workspace` derives the same order from the manifests;
/// this list is what `package-check` packs and `publish` prints.
pub(crate) const STACK: &[&str] = &[
    "zeropp-quant",
    "zeropp-comm",
    "zeropp-partition",
    "zeropp-engine",
    "zeropp-candle",
    "zeropp-run",
    "zeropp",
];

/// Packed and unpacked beside [`STACK`] though never published: zeropp-py,
/// the wheel's Rust side. With it the tarballs' workspace has the main
/// workspace's packages but the test helpers and xtask, so every dependency
/// resolves to the same features and its build is reused. Without it, syn
/// lacks a feature pyo3's macros turn on, and syn, every proc macro and what
/// uses them built again: 130 s of CI's doc-test step.
const PACKED_TOO: &[&str] = &["zeropp-py"];

/// Where the tarballs are unpacked and checked.
fn check_dir() -> PathBuf {
    root().join("target/package-check")
}

/// The workspace's `[profile.*]` sections, verbatim (they close the root manifest).
fn profiles() -> Result<String, String> {
    let manifest = root().join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let at = text.find("\n[profile.").ok_or("the root Cargo.toml has no [profile.*] section")?;
    Ok(text[at..].to_string())
}

/// `cargo xtask package-check [--features F]`: with the features the
/// workspace's tests were built with (`ci` passes its MPI features), so the
/// dependencies resolve to the same feature sets and their builds are reused
/// (see [`PACKED_TOO`]).
pub(crate) fn check(args: &[String]) -> Result<(), String> {
    let features = match args {
        [] => None,
        [flag, f] if flag == "--features" => Some(f.as_str()),
        other => return Err(format!("package-check: unknown arguments {other:?} (use --features F)")),
    };
    let version = crate::wheel::workspace_version()?;
    // cargo package writes to the target folder's `package/`, wherever it is.
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from);
    let mut pack = cargo();
    pack.args(["package", "--locked", "--no-verify", "--allow-dirty"]);
    for name in STACK.iter().chain(PACKED_TOO) {
        pack.args(["-p", name]);
    }
    run("cargo package (the published crates' tarballs)", pack)?;

    let dir = check_dir();
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let crates = dir.join("crates");
    std::fs::create_dir_all(&crates).map_err(|e| format!("{}: {e}", crates.display()))?;
    let mut patch = String::from("[patch.crates-io]\n");
    for name in STACK.iter().chain(PACKED_TOO) {
        let tarball = target.join(format!("package/{name}-{version}.crate"));
        // `-m`: the files get the time of unpacking. A tarball's entries carry
        // fixed times, and cargo, which judges a path crate fresh by its files'
        // times, would otherwise take a changed crate for the one built before.
        let mut c = Command::new("tar");
        c.arg("xzmf").arg(&tarball).arg("-C").arg(&crates);
        run(&format!("unpack {name}-{version}.crate"), c)?;
        if STACK.contains(name) {
            patch.push_str(&format!("{name} = {{ path = \"crates/{name}-{version}\" }}\n"));
        }
    }
    // The user's crate is outside the workspace, so `cargo fmt --all` skips it.
    let mut fmt = Command::new("rustfmt");
    fmt.args(["--check", "--edition", "2024", "--config-path"])
        .arg(root().join("rustfmt.toml"))
        .arg(root().join("tests/registry-user/src/main.rs"));
    run("rustfmt --check tests/registry-user", fmt)?;
    copy_dir(&root().join("tests/registry-user"), &dir.join("registry-user"))?;
    let manifest = format!(
        "# Written by `cargo xtask package-check`: the unpacked tarballs and a user's crate.\n\
         [workspace]\nresolver = \"3\"\nmembers = [\"crates/*\", \"registry-user\"]\n\n{patch}{}",
        profiles()?
    );
    std::fs::write(dir.join("Cargo.toml"), manifest).map_err(|e| format!("{}: {e}", dir.display()))?;
    // The workspace's lock: the same dependency versions, so their builds are shared.
    std::fs::copy(root().join("Cargo.lock"), dir.join("Cargo.lock"))
        .map_err(|e| format!("Cargo.lock: {e}"))?;

    // Everything in the tests' profile, so the registry dependencies the
    // workspace's tests built (at opt-level 3, the `"*"` override) are reused;
    // the unpacked crates themselves at opt-level 0, which compiles all seven in
    // seconds (at the tests' opt-level 2 they took minutes of CI's two cores).
    let in_check = |args: &[&str], features: Option<&str>| {
        let mut c = cargo();
        c.args(args)
            .args(["--offline", "--profile", "test"])
            .current_dir(&dir)
            .env("CARGO_TARGET_DIR", &target)
            .env("CARGO_PROFILE_TEST_OPT_LEVEL", "0");
        if let Some(f) = features {
            c.args(["--features", f]);
        }
        c
    };
    run("doc tests of every packaged library crate", in_check(&["test", "--doc", "--workspace"], features))?;
    // The CLI is checked, not linked: a linked `zeropp` would replace the
    // workspace's own `target/debug/zeropp` (built with MPI for the MPI and
    // cluster tests), since a binary's uplifted name carries no hash.
    run("check the packaged CLI", in_check(&["check", "--workspace", "--bins"], features))?;
    // The user's crate with the crates' default features, as a user gets them
    // (the doc tests above ran with `features`).
    run(
        "a user's crate on the packaged zeropp-quant and zeropp-comm: qwZ on threads",
        in_check(&["run", "--quiet", "-p", "zeropp-registry-user"], None),
    )
}

/// Copies `from` (a small crate: files and folders) to `to`.
fn copy_dir(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    for e in std::fs::read_dir(from).map_err(|e| format!("{}: {e}", from.display()))? {
        let e = e.map_err(|e| e.to_string())?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if src.is_dir() {
            if e.file_name() != "target" {
                copy_dir(&src, &dst)?;
            }
        } else {
            std::fs::copy(&src, &dst).map_err(|e| format!("{}: {e}", src.display()))?;
        }
    }
    Ok(())
}

/// `cargo xtask publish`: `cargo publish --workspace` (the crates of [`STACK`],
/// each after the ones it depends on), for real only with `--execute` and a
/// `CARGO_REGISTRY_TOKEN`; otherwise a dry run, which packs and verifies each
/// crate against the ones packed before it.
pub(crate) fn publish(args: &[String]) -> Result<(), String> {
    let execute = args.iter().any(|a| a == "--execute");
    let token = std::env::var("CARGO_REGISTRY_TOKEN").is_ok_and(|t| !t.is_empty());
    if execute && !token {
        return Err("publish --execute needs CARGO_REGISTRY_TOKEN".into());
    }
    eprintln!("==> publishing in stack order: {}", STACK.join(", "));
    let mut c = cargo();
    c.args(["publish", "--workspace", "--locked"]);
    if !execute {
        c.arg("--dry-run");
    }
    run(if execute { "cargo publish" } else { "cargo publish --dry-run" }, c)
}

/// `cargo xtask release-check TAG`: the tag (`v0.1.0`) is the workspace's
/// version, and CHANGELOG.md has a dated section for it (`## [0.1.0] - 2026-12-24`,
/// what `## [Unreleased]` becomes when the release is cut), so a release never
/// ships an undated or missing entry.
pub(crate) fn release_check(args: &[String]) -> Result<(), String> {
    let tag = args.first().ok_or("release-check needs the tag, e.g. v0.1.0")?;
    let version = crate::wheel::workspace_version()?;
    if tag.strip_prefix('v') != Some(version.as_str()) {
        return Err(format!("the tag {tag} is not v{version}, the crates' version (Cargo.toml)"));
    }
    let path = root().join("CHANGELOG.md");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    changelog_is_dated(&text, &version)?;
    eprintln!("==> release {tag}: the crates' version, with a dated CHANGELOG.md section");
    Ok(())
}

/// CHANGELOG.md's heading for `version` carries a date (YYYY-MM-DD).
fn changelog_is_dated(text: &str, version: &str) -> Result<(), String> {
    let head = format!("## [{version}] - ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&head))
        .ok_or_else(|| format!("CHANGELOG.md has no `{head}YYYY-MM-DD` section"))?;
    let date = line[head.len()..].trim();
    let ok = date.len() == 10
        && date.char_indices().all(|(i, c)| if i == 4 || i == 7 { c == '-' } else { c.is_ascii_digit() });
    if ok { Ok(()) } else { Err(format!("CHANGELOG.md's section `{line}` has no date (YYYY-MM-DD)")) }
}

#[cfg(test)]
mod tests {
    use super::changelog_is_dated;

    #[test]
    fn a_release_needs_a_dated_changelog_section() {
        assert!(changelog_is_dated("# Changelog\n## [0.1.0] - 2026-12-24\n", "0.1.0").is_ok());
        assert!(changelog_is_dated("## [0.1.0] - Unreleased\n", "0.1.0").is_err());
        assert!(changelog_is_dated("## [0.0.9] - 2026-12-24\n", "0.1.0").is_err());
        assert!(changelog_is_dated("## [0.1.0] - 2026/12/24\n", "0.1.0").is_err());
    }
}
