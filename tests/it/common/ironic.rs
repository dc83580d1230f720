//! Ironic's own code in the tests: the virtualenv's Python and helpers
//! that emit Ironic's real notifications.

use super::*;

/// Python with Ironic installed (a virtualenv at `$IIW_IRONIC_VENV`, default
/// `target/ironic-venv`, made on first use from PyPI by
/// `tests/helpers/ironic_venv.py`, which `.ci/run` also starts ahead of the
/// build), to run Ironic's own code.
pub fn ironic_python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let venv = std::env::var_os("IIW_IRONIC_VENV")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ironic-venv")
                });
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/ironic_venv.py");
            let python = tool(
                "python3",
                &[script.to_str().unwrap(), venv.to_str().unwrap()],
            );
            PathBuf::from(python.trim())
        })
        .clone()
}

/// Emits provision_set notifications through Ironic's notifier as conductor
/// `host`; each spec is one transition (see tests/helpers/emit_notification.py).
pub fn emit_notifications(host: &str, specs: &[Value]) {
    emit_notifications_on("ironic", host, specs)
}

/// As [`emit_notifications`], on Ironic's `control_exchange` `exchange`: a
/// test's own, which no other test's worker reads.
pub fn emit_notifications_on(exchange: &str, host: &str, specs: &[Value]) {
    use std::io::Write;
    let mut child = std::process::Command::new(ironic_python())
        .arg(notifier_script())
        .arg(host)
        .arg(exchange)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines: String = specs.iter().map(|s| format!("{s}\n")).collect();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "emit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Ironic's notifier, a transition a line on stdin.
fn notifier_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/emit_notification.py")
}

/// A long-lived helper process that answers each line written to its stdin
/// with one line on its stdout (the Ironic helpers in tests/helpers): one import
/// of Ironic (seconds of CPU) for a test's many operations.
pub struct LineHelper {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    /// Its stderr (a pipe nobody reads could fill and stop it).
    stderr: tempfile::NamedTempFile,
}

impl LineHelper {
    /// Starts `cmd` with its stdin and stdout piped to this helper.
    pub fn start(mut cmd: tokio::process::Command) -> LineHelper {
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr.reopen().unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
        let lines = tokio::io::AsyncBufReadExt::lines(stdout);
        LineHelper {
            child,
            stdin,
            lines,
            stderr,
        }
    }

    /// Writes `line` and returns the answer; panics, with the helper's
    /// stderr, when none comes within two minutes.
    pub async fn ask(&mut self, line: &str) -> String {
        use tokio::io::AsyncWriteExt;
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        match tokio::time::timeout(Duration::from_secs(120), self.lines.next_line()).await {
            Ok(Ok(Some(answer))) => answer,
            other => panic!(
                "the helper answered {other:?} (exit {:?}); stderr {}",
                self.child.try_wait(),
                std::fs::read_to_string(self.stderr.path()).unwrap_or_default()
            ),
        }
    }
}

/// Ironic's notifier as one long-lived conductor process (see
/// tests/helpers/emit_notification.py), for tests that emit in turns.
pub struct Notifier(LineHelper);

impl Notifier {
    /// The notifier of conductor `host`.
    pub fn start(host: &str) -> Notifier {
        let mut cmd = tokio::process::Command::new(ironic_python());
        cmd.arg(notifier_script()).arg(host);
        Notifier(LineHelper::start(cmd))
    }

    /// Emits the transitions `specs` in turn, each once Ironic has sent the
    /// one before.
    pub async fn emit(&mut self, specs: &[Value]) {
        for spec in specs {
            assert_eq!(self.0.ask(&spec.to_string()).await, "sent", "{spec}");
        }
    }
}
