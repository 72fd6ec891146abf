/**
 * A real hotloop-serve for the integration tests: `hotloop-serve run` on free loopback ports
 * with a one-model config, ready once `grpc.health.v1.Health/Check` answers SERVING through
 * Ray Serve's proxy; stopped with SIGINT (Ray shuts down), SIGKILL to its process group
 * after 60 s.
 *
 * Environment:
 * - HOTLOOP_ADDRESS: use this running server instead of starting one.
 * - HOTLOOP_SERVE_BIN: the hotloop-serve executable (default: the repo's .venv).
 * - HOTLOOP_TEST_MODEL: the model name (default gemma-3-270m).
 * - HOTLOOP_TEST_VERBOSE=1: pass the server's output through.
 */

import { type ChildProcess, spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

import * as grpc from "@grpc/grpc-js";

import { BinaryReader } from "@bufbuild/protobuf/wire";

export const MODEL = process.env["HOTLOOP_TEST_MODEL"] ?? "gemma-3-270m";
const READY_TIMEOUT_MS = 300_000;
const STOP_TIMEOUT_MS = 60_000;
const SESSION_CONTEXT_TOKENS = 4096;

export interface RunningServer {
  address: string;
  /** Seconds from spawn to SERVING (0 for HOTLOOP_ADDRESS). */
  startupS: number;
  /** `engine.session_context_tokens` of the config it was started with; undefined for
   * HOTLOOP_ADDRESS (a server configured elsewhere). */
  sessionContextTokens?: number;
  stop(): Promise<void>;
}

export function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const srv = createServer();
    srv.unref();
    srv.on("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const address = srv.address();
      const port = typeof address === "object" && address ? address.port : 0;
      srv.close(() => resolvePort(port));
    });
  });
}

/** `grpc.health.v1.HealthCheckRequest` with no service: an empty message. */
const encodeEmpty = (): Buffer => Buffer.alloc(0);

/** SERVING (1) from `grpc.health.v1.HealthCheckResponse` (field 1, enum status). */
function decodeHealthStatus(data: Buffer): number {
  const reader = new BinaryReader(data);
  let status = 0;
  while (reader.pos < reader.len) {
    const tag = reader.uint32();
    if (tag >>> 3 === 1 && (tag & 7) === 0) status = reader.int32();
    else reader.skip(tag & 7);
  }
  return status;
}

function healthCheck(client: grpc.Client, application: string): Promise<number> {
  const md = new grpc.Metadata();
  md.set("application", application);
  return new Promise((resolveStatus, reject) => {
    client.makeUnaryRequest(
      "/grpc.health.v1.Health/Check",
      encodeEmpty,
      decodeHealthStatus,
      {},
      md,
      { deadline: Date.now() + 5000 },
      (err, status) => (err ? reject(err) : resolveStatus(status ?? 0)),
    );
  });
}

/** Polls the health service until the model answers SERVING (or the process dies). */
export async function waitUntilServing(
  address: string,
  application: string,
  timeoutMs: number,
  died: () => string | undefined = () => undefined,
): Promise<void> {
  const client = new grpc.Client(address, grpc.credentials.createInsecure());
  const until = Date.now() + timeoutMs;
  let last = "no answer yet";
  try {
    for (;;) {
      const exit = died();
      if (exit) throw new Error(`hotloop-serve exited before serving (${exit})`);
      try {
        const status = await healthCheck(client, application);
        if (status === 1) return;
        last = `health status ${status}`;
      } catch (err) {
        last = err instanceof Error ? err.message : String(err);
      }
      if (Date.now() > until) throw new Error(`${application} not serving on ${address} after ${timeoutMs} ms: ${last}`);
      await new Promise((r) => setTimeout(r, 500));
    }
  } finally {
    client.close();
  }
}

function serveBin(): string {
  const fromEnv = process.env["HOTLOOP_SERVE_BIN"];
  if (fromEnv) return fromEnv;
  // dist/test/server.js -> clients/typescript -> repo root
  const bin = resolve(__dirname, "..", "..", "..", "..", ".venv", "bin", "hotloop-serve");
  if (!existsSync(bin)) throw new Error(`${bin} not found: run \`make setup\` or set HOTLOOP_SERVE_BIN`);
  return bin;
}

export async function startServer(): Promise<RunningServer> {
  const existing = process.env["HOTLOOP_ADDRESS"];
  if (existing) {
    await waitUntilServing(existing, MODEL, 30_000);
    return { address: existing, startupS: 0, stop: async () => {} };
  }
  const grpcPort = await freePort();
  const httpPort = await freePort();
  const dir = mkdtempSync(join(tmpdir(), "hotloop-ts-"));
  const config = join(dir, "hotloop.yaml");
  writeFileSync(
    config,
    [
      `server: {grpc_port: ${grpcPort}, http_port: ${httpPort}}`,
      "telemetry: {enabled: false}",
      "models:",
      `  - name: ${MODEL}`,
      `    engine: {context_tokens: 8192, session_context_tokens: ${SESSION_CONTEXT_TOKENS}, hot_sessions: 4, threads: 2}`,
      "",
    ].join("\n"),
  );
  const verbose = process.env["HOTLOOP_TEST_VERBOSE"] === "1";
  const started = Date.now();
  const child: ChildProcess = spawn(serveBin(), ["run", "--port", String(grpcPort), "--config", config], {
    detached: true, // its own process group, so a stuck Ray can be killed whole
    stdio: ["ignore", verbose ? "inherit" : "pipe", verbose ? "inherit" : "pipe"],
    env: { ...process.env, HOTLOOP_HOME: dir },
  });
  let output = "";
  const keep = (data: Buffer): void => {
    output = (output + data.toString("utf8")).slice(-20_000);
  };
  child.stdout?.on("data", keep);
  child.stderr?.on("data", keep);
  let exit: string | undefined;
  const exited = new Promise<void>((resolveExit) =>
    child.on("exit", (code, signal) => {
      exit = signal ? `signal ${signal}` : `exit code ${code}`;
      resolveExit();
    }),
  );
  const killGroup = (): void => {
    if (exit !== undefined || child.pid === undefined) return;
    try {
      process.kill(-child.pid, "SIGKILL");
    } catch {
      // already gone
    }
  };
  // Never leave Ray behind if the test process dies without calling stop().
  process.on("exit", killGroup);

  const stop = async (): Promise<void> => {
    if (exit === undefined) {
      child.kill("SIGINT");
      const timer = setTimeout(killGroup, STOP_TIMEOUT_MS);
      await exited;
      clearTimeout(timer);
    }
    process.off("exit", killGroup);
    rmSync(dir, { recursive: true, force: true });
  };

  const address = `127.0.0.1:${grpcPort}`;
  try {
    await waitUntilServing(address, MODEL, READY_TIMEOUT_MS, () => exit);
  } catch (err) {
    await stop();
    throw new Error(`${(err as Error).message}\n--- hotloop-serve output (tail) ---\n${output}`);
  }
  return { address, startupS: (Date.now() - started) / 1000, sessionContextTokens: SESSION_CONTEXT_TOKENS, stop };
}
