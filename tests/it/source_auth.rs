//! `[deploy]image_server_*` as Ironic 39 reads them: the credentials of the
//! user's image servers, sent with the worker's downloads of http(s)
//! sources to the hosts `image_server_auth_hosts` /
//! `image_server_auth_permit_unknown_hosts` permit, and not the worker's
//! own image port (whose options are `[http]auth_*`).

use crate::common;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use common::*;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Serves one file to requests carrying `user:password` (Basic), 401 to
/// others; records the `Authorization` each request carried.
struct BasicSource {
    port: u16,
    seen: Arc<Mutex<Vec<Option<String>>>>,
}

type SourceState = (PathBuf, String, Arc<Mutex<Vec<Option<String>>>>);

async fn serve_basic(State((file, expected, seen)): State<SourceState>, req: Request) -> Response {
    let auth = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    seen.lock().unwrap().push(auth.clone());
    if auth.as_deref() != Some(expected.as_str()) {
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Basic realm=\"images\"")],
        )
            .into_response();
    }
    let body = std::fs::read(&file).unwrap();
    ([(header::CONTENT_LENGTH, body.len().to_string())], body).into_response()
}

impl BasicSource {
    async fn start(file: PathBuf, user: &str, password: &str) -> BasicSource {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
        let state = (file, format!("Basic {token}"), seen.clone());
        let app = axum::Router::new().fallback(serve_basic).with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, app).await });
        BasicSource { port, seen }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/disk.raw", self.port)
    }

    fn carried_credentials(&self) -> bool {
        let seen = self.seen.lock().unwrap();
        !seen.is_empty() && seen.iter().all(Option::is_some)
    }
}

/// An environment with `lines` in its `[deploy]` section.
fn env_with_deploy(lines: &str) -> Env {
    let env = Env::new("");
    let text = std::fs::read_to_string(&env.config).unwrap();
    std::fs::write(
        &env.config,
        text.replacen("[deploy]\n", &format!("[deploy]\n{lines}\n"), 1),
    )
    .unwrap();
    env
}

#[tokio::test]
async fn source_credentials_go_to_permitted_hosts_only() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk.raw");
    random_file(&file, 2 << 20, 41);
    let creds = "image_server_auth_strategy = \"http_basic\"\n\
                 image_server_user = \"images\"\nimage_server_password = \"pw\"\n";
    let cases = [
        ("", true),
        ("image_server_auth_hosts = [\"127.0.0.1\"]\n", true),
        ("image_server_auth_hosts = [\".example.net\"]\n", false),
        ("image_server_auth_permit_unknown_hosts = false\n", false),
    ];
    for (scope, sent) in cases {
        let source = BasicSource::start(file.clone(), "images", "pw").await;
        let env = env_with_deploy(&format!("{creds}{scope}"));
        let (ok, done) = env.prepare(&node(), &source.url(), &[]).await;
        assert_eq!(source.carried_credentials(), sent, "{scope}: {done}");
        if sent {
            assert!(ok, "{scope}: {done}");
            served(&file).context(scope).check(&done);
        } else {
            assert!(!ok, "{scope}: {done}");
            assert_eq!(done["error"]["code"], "source_not_allowed", "{done}");
        }
    }
    // Without the strategy, nothing is sent.
    let source = BasicSource::start(file.clone(), "images", "pw").await;
    let env = env_with_deploy("image_server_user = \"images\"\nimage_server_password = \"pw\"");
    let (ok, _) = env.prepare(&node(), &source.url(), &[]).await;
    assert!(!ok && !source.carried_credentials());
}

/// The image servers' credentials do not close the worker's own port.
#[tokio::test]
async fn the_image_port_has_its_own_credentials() {
    let env = env_with_deploy(
        "image_server_auth_strategy = \"http_basic\"\n\
         image_server_user = \"images\"\nimage_server_password = \"pw\"",
    );
    let file = env.root().join("allowed/disk.img");
    random_file(&file, 1 << 20, 42);
    let n = node();
    let (ok, done) = env
        .prepare(&n, &format!("file://{}", file.display()), &[])
        .await;
    assert!(ok, "{done}");
    let worker = env.serve().await;
    let (status, body) = get(done["image_url"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(body.len(), 1 << 20);
    drop(worker);
}
