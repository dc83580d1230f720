//! Glance image ids as sources: a small Keystone v3 + Image API v2 server
//! (what the worker calls of them, nothing more) started by the test, real
//! images made with qemu-img, and the worker fetching, verifying, converting
//! and caching under the image id as Ironic does.

use crate::common;

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get as route_get, post};
use common::*;
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct World {
    /// image id -> (Image API document, data file)
    images: HashMap<String, (Value, PathBuf)>,
    tokens: HashSet<String>,
    issued: usize,
    metadata_gets: usize,
    data_gets: usize,
    static_token: String,
}

/// Keystone (`/identity/v3/auth/tokens`) and Glance (`/image/v2/...`) on one
/// port; the catalog points at the Image API under `/image`.
struct Cloud {
    addr: std::net::SocketAddr,
    world: Arc<Mutex<World>>,
}

impl Cloud {
    async fn start() -> Cloud {
        let world = Arc::new(Mutex::new(World {
            static_token: "static-admin-token".into(),
            ..World::default()
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/identity/v3/auth/tokens", post(issue))
            .route("/image/v2/images/{id}", route_get(image))
            .route("/image/v2/images/{id}/file", route_get(data))
            .with_state((world.clone(), addr));
        tokio::spawn(async move { axum::serve(listener, app).await });
        Cloud { addr, world }
    }

    /// Registers an image the way Glance describes it after an upload.
    fn add(&self, file: &Path, disk_format: &str) -> String {
        let id = node();
        let bytes = std::fs::read(file).unwrap();
        let doc = json!({
            "id": id, "name": "test-image", "status": "active",
            "disk_format": disk_format, "container_format": "bare",
            "checksum": md5sum(file),
            "os_hash_algo": "sha512",
            "os_hash_value": sha512sum(file),
            "size": bytes.len(),
            "updated_at": "2026-11-30T05:00:00Z",
            "visibility": "public",
        });
        self.world
            .lock()
            .unwrap()
            .images
            .insert(id.clone(), (doc, file.to_path_buf()));
        id
    }

    fn edit(&self, id: &str, f: impl FnOnce(&mut Value)) {
        f(&mut self.world.lock().unwrap().images.get_mut(id).unwrap().0);
    }

    fn stats(&self) -> (usize, usize, usize) {
        let w = self.world.lock().unwrap();
        (w.issued, w.metadata_gets, w.data_gets)
    }

    fn revoke_all(&self) {
        self.world.lock().unwrap().tokens.clear();
    }

    fn auth_url(&self) -> String {
        format!("http://{}/identity/v3", self.addr)
    }
}

type St = (Arc<Mutex<World>>, std::net::SocketAddr);

async fn issue(State((world, addr)): State<St>, body: axum::Json<Value>) -> Response {
    let identity = &body["auth"]["identity"];
    let ok = match identity["methods"][0].as_str() {
        Some("password") => {
            let user = &identity["password"]["user"];
            user["name"] == "ironic"
                && user["password"] == "s3cret"
                && user["domain"]["name"] == "Default"
                && body["auth"]["scope"]["project"]["name"] == "service"
        }
        Some("application_credential") => {
            let ac = &identity["application_credential"];
            ac["id"] == "ac-1" && ac["secret"] == "ac-secret"
        }
        _ => false,
    };
    if !ok {
        return (
            StatusCode::UNAUTHORIZED,
            "The request you have made requires authentication.",
        )
            .into_response();
    }
    let mut w = world.lock().unwrap();
    w.issued += 1;
    let token = format!("tok-{}", uuid::Uuid::new_v4().simple());
    w.tokens.insert(token.clone());
    let body = json!({"token": {
    "expires_at": "2099-01-01T00:00:00.000000Z",
    "catalog": [
        {"type": "identity", "endpoints": [
            {"interface": "internal", "region_id": "RegionOne", "url": format!("http://{addr}/identity")}]},
        {"type": "image", "endpoints": [
            {"interface": "public", "region_id": "RegionOne", "url": "http://192.0.2.1:9292"},
            {"interface": "internal", "region_id": "RegionTwo", "url": "http://192.0.2.2:9292"},
            {"interface": "internal", "region_id": "RegionOne", "url": format!("http://{addr}/image")}]}
    ]}});
    (
        StatusCode::CREATED,
        [("X-Subject-Token", token)],
        axum::Json(body),
    )
        .into_response()
}

fn authorised(w: &World, headers: &HeaderMap) -> bool {
    let t = headers
        .get("X-Auth-Token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    w.tokens.contains(t) || t == w.static_token
}

async fn image(
    State((world, _)): State<St>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    let mut w = world.lock().unwrap();
    if !authorised(&w, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    w.metadata_gets += 1;
    match w.images.get(&id) {
        Some((doc, _)) => axum::Json(doc.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn data(
    State((world, _)): State<St>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    let path = {
        let mut w = world.lock().unwrap();
        if !authorised(&w, &headers) {
            return StatusCode::UNAUTHORIZED.into_response();
        }
        w.data_gets += 1;
        match w.images.get(&id) {
            Some((_, path)) => path.clone(),
            None => return StatusCode::NOT_FOUND.into_response(),
        }
    };
    let bytes = tokio::fs::read(path).await.unwrap();
    ([("Content-Type", "application/octet-stream")], bytes).into_response()
}

fn password_auth(cloud: &Cloud, password: &str) -> String {
    format!(
        "[glance]\nauth_type = \"password\"\nauth_url = \"{}\"\nusername = \"ironic\"\npassword = \"{password}\"\n\
         user_domain_name = \"Default\"\nproject_name = \"service\"\nproject_domain_name = \"Default\"\n\
         region_name = \"RegionOne\"\nvalid_interfaces = \"internal,public\"\n",
        cloud.auth_url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glance_image_fetched_by_id_converted_and_cached_under_its_id() {
    let cloud = Cloud::start().await;
    let env = Env::new(&password_auth(&cloud, "s3cret"));
    let raw = env.root().join("disk.raw");
    patchy_raw(&raw, 48 << 20, 5);
    let img = env.root().join("disk.qcow2");
    qcow2_from(&raw, &img, &[]);
    let reference = env.root().join("ref.raw");
    reference_raw(&img, &reference);
    let id = cloud.add(&img, "qcow2");

    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let first = broker.call(&env.host, prepare_cmd(&node(), &id)).await;
    assert_eq!(first["status"], "success", "{first}");
    assert_eq!(first["cache"], "miss");
    assert_eq!(first["converted"], true);
    assert_eq!(first["image_source"], id.as_str());
    // Glance's os_hash is sha512: kept as the algorithm, recomputed over
    // the converted bytes.
    served(&reference).sha512().check(&first);
    assert!(
        env.masters().contains(&format!("{id}.converted")),
        "master named after the image id: {:?}",
        env.masters()
    );
    let (status, body) = get(first["image_url"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(body, std::fs::read(&reference).unwrap());

    // Another node, same image: Glance is asked for the metadata, the data is
    // not fetched again, and the token is reused.
    let second = broker
        .call(&env.host, prepare_cmd(&node(), &format!("glance://{id}")))
        .await;
    assert_eq!(second["status"], "success", "{second}");
    assert_eq!(second["cache"], "hit");
    assert_eq!(second["image_checksum"], first["image_checksum"]);
    assert_eq!(
        cloud.stats(),
        (1, 2, 1),
        "(tokens issued, metadata GETs, data GETs)"
    );

    // Tokens revoked behind the worker's back: it authenticates again.
    cloud.revoke_all();
    let raw2 = env.root().join("other.raw");
    random_file(&raw2, 3 << 20, 9);
    let id2 = cloud.add(&raw2, "raw");
    let third = broker.call(&env.host, prepare_cmd(&node(), &id2)).await;
    served(&raw2).sha512().check(&third);
    assert_eq!(third["converted"], false);
    assert_eq!(cloud.stats().0, 2, "one new token after the 401");
    drop(worker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glance_failures_have_clear_codes_and_leave_no_file() {
    let cloud = Cloud::start().await;
    let env = Env::new(&password_auth(&cloud, "s3cret"));
    let raw = env.root().join("disk.raw");
    random_file(&raw, 2 << 20, 3);
    let id = cloud.add(&raw, "raw");

    let (ok, ev) = env.prepare(&node(), &node(), &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_not_found", "{ev}");

    // Glance's checksum does not match the bytes it serves.
    let bad = cloud.add(&raw, "raw");
    cloud.edit(&bad, |d| d["os_hash_value"] = json!("0".repeat(128)));
    let (ok, ev) = env.prepare(&node(), &bad, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "checksum_mismatch", "{ev}");

    // An image still being uploaded has no data.
    let queued = cloud.add(&raw, "raw");
    cloud.edit(&queued, |d| d["status"] = json!("queued"));
    let (ok, ev) = env.prepare(&node(), &queued, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_not_found", "{ev}");

    // Declared format differs from the bytes.
    let liar = cloud.add(&raw, "qcow2");
    let (ok, ev) = env.prepare(&node(), &liar, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "format_mismatch", "{ev}");
    assert!(env.masters().is_empty(), "{:?}", env.masters());
    assert!(env.temporaries().is_empty());

    // Wrong password: refused, and said so.
    let data_gets = cloud.stats().2;
    let wrong = Env::new(&password_auth(&cloud, "nope"));
    let (ok, ev) = wrong.prepare(&node(), &id, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_not_allowed", "{ev}");
    assert!(
        ev["error"]["message"].as_str().unwrap().contains("401"),
        "{ev}"
    );
    assert_eq!(
        cloud.stats().2,
        data_gets,
        "no data fetched without a token"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_credentials_and_static_tokens() {
    let cloud = Cloud::start().await;
    let raw = tempfile::tempdir().unwrap();
    let file = raw.path().join("disk.raw");
    random_file(&file, 1 << 20, 4);
    let id = cloud.add(&file, "raw");

    let env = Env::new(&format!(
        "[glance]\nauth_type = \"v3applicationcredential\"\nauth_url = \"{}\"\n\
         application_credential_id = \"ac-1\"\napplication_credential_secret = \"ac-secret\"\n\
         region_name = \"RegionOne\"\n",
        cloud.auth_url()
    ));
    let (ok, ev) = env.prepare(&node(), &id, &[]).await;
    assert!(ok, "{ev}");
    served(&file).sha512().check(&ev);

    let endpoint = format!("http://{}/image", cloud.addr);
    let env = Env::new(&format!(
        "[glance]\nauth_type = \"admin_token\"\ntoken = \"static-admin-token\"\nendpoint_override = \"{endpoint}\"\n"
    ));
    let (ok, ev) = env.prepare(&node(), &id, &[]).await;
    assert!(ok, "{ev}");
    let env = Env::new(&format!(
        "[glance]\nauth_type = \"admin_token\"\ntoken = \"forged\"\nendpoint_override = \"{endpoint}\"\n"
    ));
    let (ok, ev) = env.prepare(&node(), &id, &[]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "source_not_allowed", "{ev}");
}
