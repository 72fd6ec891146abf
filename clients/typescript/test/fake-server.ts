/**
 * An in-process grpc-js server that speaks hotloop's API (and Ray Serve's ListApplications)
 * with scripted behaviour, for checking the client's wire contract without Ray: the metadata
 * it sends, the session key, the settings on every turn, retries and stream failures.
 */

import * as grpc from "@grpc/grpc-js";

import type * as pbc from "../src/gen/hotloop/v1/common";
import { ModelServiceService, type ModelServiceServer } from "../src/gen/hotloop/v1/model";
import * as pbs from "../src/gen/hotloop/v1/session";

export interface Recorded {
  method: string;
  metadata: Record<string, string>;
  request: unknown;
}

/** What one Generate attempt does: send these texts, then end (or fail with a status). */
export interface GenerateScript {
  texts?: string[];
  /** The status the attempt ends with; `metadata` carries trailers (the rich error details). */
  fail?: { code: grpc.status; details: string; metadata?: grpc.Metadata };
  /** Stay open after the texts until the client cancels. */
  hang?: boolean;
}

export function encodeApplicationNames(names: string[], extra = true): Buffer {
  const parts: Buffer[] = [];
  if (extra) parts.push(Buffer.from([0x10, 0x96, 0x01])); // field 2, varint 150: skipped
  for (const name of names) {
    const bytes = Buffer.from(name, "utf8");
    parts.push(Buffer.from([0x0a, bytes.length]), bytes);
  }
  return Buffer.concat(parts);
}

function flatMetadata(md: grpc.Metadata): Record<string, string> {
  const out: Record<string, string> = {};
  for (const [key, value] of Object.entries(md.getMap())) out[key] = String(value);
  return out;
}

export class FakeServer {
  readonly calls: Recorded[] = [];
  applications = ["alpha", "beta"];
  /** Scripts of the next Generate attempts, in order; when empty, a normal two-chunk reply. */
  generateScripts: GenerateScript[] = [];
  /** Statuses the next unary calls fail with, in order. */
  unaryFailures: { code: grpc.status; details: string }[] = [];
  /** What ListReplicas answers: direct addresses by rank (empty: direct ingress off). */
  replicaAddresses: string[] = [];
  /** Generate calls the client cancelled so far. */
  cancellations = 0;
  readonly sessions = new Map<string, pbc.Settings>();
  /** What ExportSession streams for a session (default: `exportBytes` bytes of a pattern). */
  readonly blobs = new Map<string, Buffer>();
  exportBytes = 2.5 * 1024 * 1024;
  /** ExportSession stops this many bytes short of its total (a broken stream). */
  exportShortBy = 0;
  /** ImportSession parts received so far, per session key. */
  private readonly imports = new Map<string, Buffer[]>();
  private nextId = 1;
  private server = new grpc.Server();
  address = "";

  private record(method: string, call: { metadata: grpc.Metadata; request?: unknown }): void {
    this.calls.push({ method, metadata: flatMetadata(call.metadata), request: call.request });
  }

  private failUnary<T>(callback: grpc.sendUnaryData<T>): boolean {
    const failure = this.unaryFailures.shift();
    if (!failure) return false;
    callback({ code: failure.code, details: failure.details });
    return true;
  }

  private session(id: string, callback: grpc.sendUnaryData<pbs.Session>): void {
    const settings = this.sessions.get(id);
    if (!settings) {
      callback({ code: grpc.status.NOT_FOUND, details: `session ${id} not found` });
      return;
    }
    callback(null, { id, model: "alpha", settings, contextTokens: 7, state: "hot", servedBy: undefined, lastUsedUnix: 0 });
  }

  async start(): Promise<string> {
    const models: ModelServiceServer = {
      listModels: (call, callback) => {
        this.record("ListModels", call);
        if (this.failUnary(callback)) return;
        callback(null, {
          models: this.applications.map((name) => ({
            name,
            architecture: "gemma3",
            contextLength: 4096,
            trainContextLength: 32768,
            quantization: "Q4_K_M",
            hasChatTemplate: false,
            chatTemplateSource: "builtin:gemma",
            parameters: 268098176n,
            sizeBytes: 253000000n,
            vocabSize: 262144,
            replicas: 1,
          })),
        });
      },
      getModel: (call, callback) => {
        this.record("GetModel", call);
        if (this.failUnary(callback)) return;
        callback({ code: grpc.status.NOT_FOUND, details: `model ${call.request.model} not found` });
      },
      tokenize: (call, callback) => {
        this.record("Tokenize", call);
        callback(null, { tokens: [2, 9259] });
      },
      listReplicas: (call, callback) => {
        this.record("ListReplicas", call);
        const replicas = this.replicaAddresses.map((address, rank) => ({ rank, address }));
        callback(null, { model: call.request.model, replicas, routing: "rendezvous-blake2b-v1", refreshS: 10 });
      },
    };
    const sessions: pbs.SessionServiceServer = {
      createSession: (call, callback) => {
        this.record("CreateSession", call);
        if (this.failUnary(callback)) return;
        const id = `s${this.nextId++}.signed`;
        // Like the server: every field filled in.
        const settings: pbc.Settings = {
          temperature: 0.800000011920929,
          sampleLen: 256,
          topP: 0.949999988079071,
          topK: 40,
          repeatPenalty: 1.100000023841858,
          repeatLastN: 64,
          stop: [],
          minP: 0.05000000074505806,
          truncateHistory: false,
          ...Object.fromEntries(Object.entries(call.request.settings ?? {}).filter(([, v]) => v !== undefined)),
        };
        this.sessions.set(id, settings);
        callback(null, {
          id,
          model: call.request.model,
          settings,
          contextTokens: 0,
          state: "new",
          servedBy: undefined,
          lastUsedUnix: 0,
        });
      },
      generate: (call) => {
        this.record("Generate", call);
        call.on("cancelled", () => this.cancellations++);
        if (!this.sessions.has(call.request.sessionId)) {
          call.emit("error", { code: grpc.status.NOT_FOUND, details: "session not found" });
          return;
        }
        const script = this.generateScripts.shift() ?? { texts: ["Hello", " world"] };
        for (const text of script.texts ?? []) call.write(chunk(text));
        if (script.hang) return;
        if (script.fail) {
          call.emit("error", script.fail);
          return;
        }
        call.write({
          ...chunk(""),
          finishReason: 2,
          usage: { promptTokens: 10, cachedTokens: 4, restoredTokens: 0, prefilledTokens: 6, completionTokens: 2 },
          timings: { queueMs: 0.1, prefillMs: 5, timeToFirstTokenMs: 5, decodeMs: 3 },
          servedBy: { replica: "r0", replicaRank: 0, cacheHit: true },
        });
        call.end();
      },
      warmup: (call, callback) => {
        this.record("Warmup", call);
        callback(null, {
          usage: { promptTokens: 5, cachedTokens: 0, restoredTokens: 0, prefilledTokens: 5, completionTokens: 0 },
          contextTokens: 5,
          servedBy: undefined,
        });
      },
      getSession: (call, callback) => {
        this.record("GetSession", call);
        if (this.failUnary(callback)) return;
        this.session(call.request.sessionId, callback);
      },
      updateSettings: (call, callback) => {
        this.record("UpdateSettings", call);
        const settings = { ...(call.request.settings ?? { stop: [] }) };
        this.sessions.set(call.request.sessionId, settings);
        this.session(call.request.sessionId, callback);
      },
      clearCache: (call, callback) => {
        this.record("ClearCache", call);
        this.session(call.request.sessionId, callback);
      },
      closeSession: (call, callback) => {
        this.record("CloseSession", call);
        if (!this.sessions.delete(call.request.sessionId)) {
          callback({ code: grpc.status.NOT_FOUND, details: "session not found" });
          return;
        }
        callback(null, {});
      },
      forkSession: (call, callback) => {
        this.record("ForkSession", call);
        if (this.failUnary(callback)) return;
        const source = this.sessions.get(call.request.sessionId);
        if (!source) {
          callback({ code: grpc.status.NOT_FOUND, details: "session not found" });
          return;
        }
        const given = Object.values(call.request.settings ?? {}).some((v) => v !== undefined && !Array.isArray(v));
        const id = `f${this.nextId++}.signed`;
        this.sessions.set(id, given ? { ...source, ...definedFields(call.request.settings) } : { ...source });
        this.session(id, callback);
      },
      listSessions: (call, callback) => {
        this.record("ListSessions", call);
        if (this.failUnary(callback)) return;
        const sessions = [...this.sessions].map(([id, settings], i) => ({
          id,
          model: call.request.model,
          settings,
          contextTokens: 7,
          state: "hot",
          servedBy: { replica: `r${i % 2}`, replicaRank: i % 2, cacheHit: true },
          lastUsedUnix: 1_700_000_000 + i,
        }));
        callback(null, { sessions: sessions.reverse() });
      },
      exportSession: (call) => {
        this.record("ExportSession", call);
        const id = call.request.sessionId;
        if (!this.sessions.has(id)) {
          call.emit("error", { code: grpc.status.NOT_FOUND, details: "session not found" });
          return;
        }
        const blob = this.blobs.get(id) ?? patternBlob(this.exportBytes);
        const sent = blob.subarray(0, blob.length - this.exportShortBy);
        const part = 1024 * 1024;
        for (let at = 0; at < sent.length; at += part) {
          call.write({ data: sent.subarray(at, at + part), totalBytes: BigInt(blob.length) });
        }
        call.end();
      },
      importSession: (call, callback) => {
        this.record("ImportSession", call);
        if (this.failUnary(callback)) return;
        const { sessionKey, data, offset, totalBytes } = call.request;
        const parts = offset === 0n ? [] : (this.imports.get(sessionKey) ?? []);
        const have = parts.reduce((n, p) => n + p.length, 0);
        if (BigInt(have) !== offset || data.length > 1024 * 1024) {
          this.imports.delete(sessionKey);
          const details = `import part at offset ${offset}, expected ${have}`;
          callback({ code: grpc.status.INVALID_ARGUMENT, details });
          return;
        }
        parts.push(Buffer.from(data));
        if (BigInt(have + data.length) < totalBytes) {
          this.imports.set(sessionKey, parts);
          callback(null, {
            id: "",
            model: call.request.model,
            settings: undefined,
            contextTokens: 0,
            state: "importing",
            servedBy: undefined,
            lastUsedUnix: 0,
          });
          return;
        }
        this.imports.delete(sessionKey);
        const blob = Buffer.concat(parts);
        if (blob.length > 0 && blob[0] !== 0x48) {
          callback({ code: grpc.status.FAILED_PRECONDITION, details: "blob of another model" });
          return;
        }
        const id = `${sessionKey}.signed`;
        this.blobs.set(id, blob);
        const settings = call.request.settings ? definedFields(call.request.settings) : { stop: [], temperature: 0.5 };
        this.sessions.set(id, settings);
        this.session(id, callback);
      },
    };
    this.server.addService(ModelServiceService, models);
    this.server.addService(pbs.SessionServiceService, sessions);
    this.server.register(
      "/ray.serve.RayServeAPIService/ListApplications",
      (call: grpc.ServerUnaryCall<Buffer, Buffer>, callback: grpc.sendUnaryData<Buffer>) => {
        this.record("ListApplications", call);
        callback(null, encodeApplicationNames(this.applications));
      },
      (value: Buffer) => value,
      (value: Buffer) => value,
      "unary",
    );
    const port = await new Promise<number>((resolve, reject) =>
      this.server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (err, p) =>
        err ? reject(err) : resolve(p),
      ),
    );
    this.address = `127.0.0.1:${port}`;
    return this.address;
  }

  /** Resolves once `n` Generate calls have been cancelled by the client (2 s at most). */
  async waitCancellations(n: number): Promise<void> {
    const until = Date.now() + 2000;
    while (this.cancellations < n) {
      if (Date.now() > until) throw new Error(`${this.cancellations} of ${n} cancellations seen by the server`);
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
  }

  /** The recorded calls of one method. */
  of(method: string): Recorded[] {
    return this.calls.filter((c) => c.method === method);
  }

  stop(): Promise<void> {
    return new Promise((resolve) => {
      this.server.tryShutdown(() => resolve());
      setTimeout(() => {
        this.server.forceShutdown();
        resolve();
      }, 2000).unref();
    });
  }
}

/** A blob like an export: starts with "H" (the fake's "this model" mark), then a pattern. */
export function patternBlob(size: number): Buffer {
  const blob = Buffer.alloc(size);
  for (let i = 0; i < size; i++) blob[i] = (i * 31 + 7) & 0xff;
  if (size > 0) blob[0] = 0x48;
  return blob;
}

function definedFields(settings: pbc.Settings | undefined): pbc.Settings {
  return {
    stop: [],
    ...Object.fromEntries(Object.entries(settings ?? {}).filter(([, v]) => v !== undefined)),
  } as pbc.Settings;
}

function chunk(text: string): pbs.GenerateChunk {
  return {
    text,
    finishReason: 0,
    usage: undefined,
    timings: undefined,
    servedBy: undefined,
    logprobs: [],
    toolCalls: [],
  };
}
