//! The `zeropp` command lines a user pastes from `README.md` and `docs/*.md`,
//! checked by the CLI itself: each line of a shell block (```` ```sh ````,
//! `bash`, `shell`, `console`) that runs `zeropp` (also behind `mpirun`,
//! `srun`, `cargo run -p zeropp --` or a `target/*/zeropp` path) is split into
//! words as a shell splits it and parsed by [`Cli`]. A flag that does not
//! exist, a missing value or a value clap refuses fails the test with the
//! file and line. `zeropp train` lines are then built into their whole
//! training configuration (`--link`, `--model`, the mode and the switches),
//! except those that read a file (`--config`); `zeropp plan` lines run,
//! except those that write a plot (`--svg`) or read a model's `config.json`
//! (`--hf-config`).

use std::path::{Path, PathBuf};

use clap::Parser;

use crate::{Cli, Command};

/// One pasted command: where it stands and its words from `zeropp` on.
#[derive(Debug)]
struct Line {
    at: String,
    words: Vec<String>,
}

/// The markdown files users read: the README and every guide in `docs/`.
fn pages() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ is readable")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The `zeropp` commands of `text`'s shell blocks (`name` for messages).
fn commands(name: &str, text: &str) -> Vec<Line> {
    let (mut out, mut in_shell, mut fenced, mut held) = (Vec::new(), false, false, String::new());
    for (i, raw) in text.lines().enumerate() {
        let t = raw.trim_start();
        if let Some(lang) = t.strip_prefix("```") {
            in_shell = !fenced && matches!(lang.trim(), "sh" | "bash" | "shell" | "console");
            fenced = !fenced;
            continue;
        }
        if !in_shell {
            continue;
        }
        // A line continued with `\` joins the next, as the shell joins them.
        let body = t.strip_prefix("$ ").unwrap_or(t);
        if let Some(head) = body.strip_suffix('\\') {
            held.push_str(head);
            continue;
        }
        let line = std::mem::take(&mut held) + body;
        let words = shlex::Shlex::new(strip_comment(&line)).collect::<Vec<_>>();
        if let Some(words) = zeropp_words(&words) {
            out.push(Line { at: format!("{name}:{}", i + 1), words });
        }
    }
    out
}

/// `line` up to its comment (a `#` at the start of a word, outside quotes).
fn strip_comment(line: &str) -> &str {
    let (mut quote, mut prev) = (None, ' ');
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if prev.is_whitespace() => return &line[..i],
            _ => {}
        }
        prev = c;
    }
    line
}

/// The words from the `zeropp` program on, when the line runs it.
fn zeropp_words(words: &[String]) -> Option<Vec<String>> {
    if words.first().is_some_and(|w| w == "cargo") && words.get(1).is_some_and(|w| w == "run") {
        let is_ours = words.windows(2).any(|w| w[0] == "-p" && w[1] == "zeropp");
        let dashes = words.iter().position(|w| w == "--")?;
        return is_ours
            .then(|| std::iter::once("zeropp".to_string()).chain(words[dashes + 1..].to_vec()).collect());
    }
    let at = words.iter().enumerate().position(|(i, w)| {
        let program =
            w == "zeropp" || w.ends_with("target/release/zeropp") || w.ends_with("target/debug/zeropp");
        // `-p zeropp` and `--path crates/zeropp` name the package, not the program.
        program && (i == 0 || !matches!(words[i - 1].as_str(), "-p" | "--package" | "--path"))
    })?;
    Some(words[at..].to_vec())
}

/// Parses `line` with the CLI, then builds or runs what is cheap to check.
fn check(line: &Line) -> Result<(), String> {
    let cli = Cli::try_parse_from(&line.words).map_err(|e| e.to_string())?;
    let has = |flag: &str| line.words.iter().any(|w| w == flag || w.starts_with(&format!("{flag}=")));
    match cli.command {
        Command::Train(args) if !has("--config") => {
            crate::config::train_config(&args).map(|_| ()).map_err(|e| e.to_string())
        }
        Command::Plan(args) if !has("--svg") && !has("--hf-config") => {
            crate::plan::run(&args).map_err(|e| e.to_string())
        }
        _ => Ok(()),
    }
}

#[test]
fn every_pasted_zeropp_line_parses() {
    let mut lines = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
        let name = page.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        lines.extend(commands(&name, &text));
    }
    // The guides hold dozens; far fewer means the extraction lost them.
    assert!(lines.len() >= 30, "only {} zeropp lines found in README.md and docs/: {lines:?}", lines.len());
    let failures: Vec<String> = lines
        .iter()
        .filter_map(|l| check(l).err().map(|e| format!("{}: `{}`\n{e}", l.at, l.words.join(" "))))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} pasted zeropp lines fail:\n\n{}",
        failures.len(),
        lines.len(),
        failures.join("\n")
    );
}

#[test]
fn the_extraction_finds_launched_and_continued_commands() {
    let text = "```sh\nmpirun -n 8 target/release/zeropp train --steps 3   # a comment\n\
                zeropp plan --params 7e9 \\\n    --nodes 2\ncargo run --release -p zeropp -- quant\n\
                cargo install --path crates/zeropp\n```\n```python\nzeropp train --bogus\n```\n";
    let got: Vec<Vec<String>> = commands("t", text).into_iter().map(|l| l.words).collect();
    let want: Vec<Vec<&str>> = vec![
        vec!["target/release/zeropp", "train", "--steps", "3"],
        vec!["zeropp", "plan", "--params", "7e9", "--nodes", "2"],
        vec!["zeropp", "quant"],
    ];
    assert_eq!(got, want);
    // A flag that does not exist fails, with clap's reason.
    let wrong =
        Line { at: "t:1".into(), words: vec!["zeropp".into(), "train".into(), "--no-such-flag".into()] };
    assert!(check(&wrong).is_err_and(|e| e.contains("--no-such-flag")));
    // So does a value only the configuration refuses (a link without a rate).
    let link = Line {
        at: "t:2".into(),
        words: ["zeropp", "train", "--link", "inter=fast"].map(String::from).to_vec(),
    };
    assert!(check(&link).is_err());
}
