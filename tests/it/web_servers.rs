//! The shipped web-server configurations (`ops/nginx/`, `ops/apache/`) in
//! front of `http_root`: nginx and Apache httpd from Debian's packages
//! (installed by `.ci/run`), their workers running as `www-data`, the worker
//! under umask 077; the agent's download through them must give exactly the
//! bytes whose MD5 was announced, and nothing after deployed/cleanup.

use crate::common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;
use std::time::Duration;

/// A web server running a shipped site file (addresses and paths replaced).
struct WebServer {
    child: std::process::Child,
    port: u16,
}

fn installed(candidates: &[&'static str], package: &str) -> &'static str {
    candidates
        .iter()
        .copied()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or_else(|| {
            panic!("{package} is not installed: `apt-get install {package}` (.ci/run does it)")
        })
}

impl WebServer {
    fn nginx(dir: &std::path::Path, http_root: &std::path::Path) -> WebServer {
        let nginx = installed(&["/usr/sbin/nginx", "/usr/bin/nginx"], "nginx");
        let port = free_port();
        let shipped = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/ops/nginx/ironic-image-worker.conf"
        ))
        .unwrap();
        let mut replaced = 0;
        let site: String = shipped
            .lines()
            .map(|line| match line.trim_start() {
                l if l.starts_with("listen ") => {
                    replaced += 1;
                    format!("    listen 127.0.0.1:{port};")
                }
                l if l.starts_with("root ") => {
                    replaced += 1;
                    format!("    root {};", http_root.display())
                }
                l if l.starts_with("access_log ") || l.starts_with("error_log ") => {
                    let (kw, _) = l.split_once(' ').unwrap();
                    format!("    {kw} {}/{kw}.log;", dir.display())
                }
                _ => line.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(replaced, 2, "the shipped file has one listen and one root");
        std::fs::write(dir.join("site.conf"), site).unwrap();
        let d = dir.display();
        std::fs::write(
            dir.join("nginx.conf"),
            format!(
                "user www-data;\nworker_processes 2;\npid {d}/nginx.pid;\nerror_log {d}/main-error.log;\n\
                 events {{ worker_connections 512; }}\n\
                 http {{\n  include /etc/nginx/mime.types;\n  client_body_temp_path {d}/body;\n\
                 proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n\
                 scgi_temp_path {d}/scgi;\n  include {d}/site.conf;\n}}\n"
            ),
        )
        .unwrap();
        let conf = dir.join("nginx.conf");
        WebServer::run(
            nginx,
            &["-c", conf.to_str().unwrap()],
            &["-g", "daemon off;"],
            port,
        )
    }

    fn apache(dir: &std::path::Path, http_root: &std::path::Path) -> WebServer {
        let apache = installed(&["/usr/sbin/apache2", "/usr/sbin/httpd"], "apache2");
        let port = free_port();
        let shipped = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/ops/apache/ironic-image-worker.conf"
        ))
        .unwrap();
        assert!(shipped.contains("192.0.2.10:8088") && shipped.contains("/httpboot"));
        let site = shipped
            .replace("192.0.2.10:8088", &format!("127.0.0.1:{port}"))
            .replace("/httpboot", &http_root.display().to_string());
        std::fs::write(dir.join("site.conf"), site).unwrap();
        let d = dir.display();
        let modules = "/usr/lib/apache2/modules";
        // What Debian's apache2.conf sets that matters here, with the
        // modules the site uses (access control, SetEnv).
        std::fs::write(
            dir.join("httpd.conf"),
            format!(
                "ServerRoot /etc/apache2\nServerName localhost\nPidFile {d}/httpd.pid\n\
                 LoadModule mpm_event_module {modules}/mod_mpm_event.so\n\
                 LoadModule authz_core_module {modules}/mod_authz_core.so\n\
                 LoadModule env_module {modules}/mod_env.so\n\
                 User www-data\nGroup www-data\nErrorLog {d}/error.log\n\
                 Define APACHE_LOG_DIR {d}\n\
                 <Directory />\n  Options FollowSymLinks\n  AllowOverride None\n  Require all denied\n</Directory>\n\
                 Include {d}/site.conf\n"
            ),
        )
        .unwrap();
        let conf = dir.join("httpd.conf");
        WebServer::run(
            apache,
            &["-f", conf.to_str().unwrap()],
            &["-DFOREGROUND"],
            port,
        )
    }

    /// Checks the configuration (`-t`), then runs the server in the
    /// foreground until it listens on `port`.
    fn run(program: &str, conf: &[&str], foreground: &[&str], port: u16) -> WebServer {
        let test = std::process::Command::new(program)
            .arg("-t")
            .args(conf)
            .output()
            .unwrap();
        assert!(
            test.status.success(),
            "{program} -t: {}",
            String::from_utf8_lossy(&test.stderr)
        );
        let child = std::process::Command::new(program)
            .args(conf)
            .args(foreground)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = WebServer { child, port };
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the web server did not start");
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for WebServer {
    /// SIGTERM to the master, which stops its workers (SIGKILL would
    /// orphan them, holding the port).
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let _ = self.child.wait();
    }
}

fn www_data_can_read(path: &std::path::Path) -> bool {
    std::process::Command::new("setpriv")
        .args(["--reuid=www-data", "--regid=www-data", "--clear-groups"])
        .arg("cat")
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_serves_what_the_worker_prepared() {
    serves_what_the_worker_prepared(WebServer::nginx, &[404]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apache_serves_what_the_worker_prepared() {
    serves_what_the_worker_prepared(WebServer::apache, &[403, 404]).await;
}

/// The scenario: prepare under umask 077, download through the server,
/// ranges, no listing (`listing` are the accepted statuses), no writes,
/// deployed and cleanup withdraw the image.
async fn serves_what_the_worker_prepared(
    start: fn(&std::path::Path, &std::path::Path) -> WebServer,
    listing: &[u16],
) {
    let env = Env::new("");
    // The test's own temporary root is private (0700); the worker's
    // directories below it are its own business.
    std::fs::set_permissions(env.root(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let http_root = env.root().join("httpboot");
    // The worker makes its directories (under umask 077) before the web
    // server starts (Apache checks its DocumentRoot): a one-shot cleanup
    // opens the pipeline, which makes them (`cache list` only reads).
    let out = env
        .run_with_umask(Some("077"), &["cleanup", "--node", &node()])
        .await;
    assert!(out.status.success(), "{out:?}");
    let server_dir = tempfile::tempdir().unwrap();
    let web = start(server_dir.path(), &http_root);

    let raw = env.root().join("disk.raw");
    patchy_raw(&raw, 40 << 20, 8);
    let img = env.root().join("src/disk.qcow2");
    qcow2_from(&raw, &img, &[]);
    let reference = env.root().join("ref.raw");
    reference_raw(&img, &reference);
    let server = SourceServer::start(&env.root().join("src")).await;

    let node = node();
    let via_server = format!("deploy.http_url={}", web.url());
    let source = server.url("disk.qcow2");
    let prepare = || async {
        let args = [
            "--set",
            &via_server,
            "prepare",
            "--node",
            &node,
            "--image-source",
            &source,
        ];
        completion_of(&env.run_with_umask(Some("077"), &args).await)
    };
    let (ok, ev) = prepare().await;
    assert!(ok, "{ev}");
    let url = ev["image_url"].as_str().unwrap();
    assert_eq!(url, format!("{}/agent_images/{node}", web.url()));
    let link = http_root.join("agent_images").join(&node);
    assert!(www_data_can_read(&link), "www-data reads through the link");

    // The agent's download, through the web server: the announced MD5 and size.
    let fetched = fetch_served(&ev, env.root()).await;
    assert_served(&ev, &fetched);
    assert_served(&ev, &reference);
    let body = std::fs::read(&fetched).unwrap();

    // A byte range, as a resuming agent asks for it.
    let resp = reqwest::Client::new()
        .get(url)
        .header("Range", "bytes=1048576-1048585")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 206);
    assert_eq!(&resp.bytes().await.unwrap()[..], &body[1048576..1048586]);

    // No listing of the nodes, no other methods.
    let (status, _) = get(&format!("{}/agent_images/", web.url())).await;
    assert!(listing.contains(&status), "listing answered {status}");
    let put = reqwest::Client::new()
        .put(url)
        .body("x")
        .send()
        .await
        .unwrap();
    let refused = [403, 405].contains(&put.status().as_u16());
    assert!(refused, "PUT answered {}", put.status());

    // deployed: the server answers 404; prepare again, then cleanup: 404 again.
    let (ok, ev) = env.oneshot(&["deployed", "--node", &node]).await;
    assert!(ok, "{ev}");
    assert_eq!(get(url).await.0, 404);
    assert!(prepare().await.0);
    assert_eq!(get(url).await.0, 200);
    let (ok, ev) = env.oneshot(&["cleanup", "--node", &node]).await;
    assert!(ok, "{ev}");
    assert_eq!(get(url).await.0, 404);
    assert_eq!(
        server.count("GET", "disk.qcow2"),
        1,
        "the cache served the second prepare"
    );
}
