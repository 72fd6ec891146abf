/**
 * The wire contract, with no I/O (the twin of the Python SDK's `_base.py`):
 *
 * - proto <-> SDK-type conversions (one function per direction),
 * - the metadata every call sends (`application` for Ray Serve's proxy, the bearer token),
 * - which failures are retried and how a broken stream is reported (`StreamProgress`),
 * - the routing key a new session is created with, and the replica owning it (direct ingress),
 * - the Ray Serve proxy's `ListApplications` codecs (generated from serve_proxy.proto).
 */

import { randomBytes } from "node:crypto";

import { Metadata } from "@grpc/grpc-js";
import { blake2b } from "blakejs";

import { fromRpcError, HotloopError, isStatusError, richDetails, Status, statusOf, TurnInterrupted } from "./errors";
import * as pbc from "./gen/hotloop/v1/common";
import type * as pbm from "./gen/hotloop/v1/model";
import { ListApplicationsRequest, ListApplicationsResponse } from "./gen/hotloop/v1/serve_proxy";
import type * as pbs from "./gen/hotloop/v1/session";
import {
  type Chunk,
  type FinishReason,
  type HistoryLike,
  type Message,
  type ModelInfo,
  type Role,
  type ServedBy,
  type SessionInfo,
  type Settings,
  SETTINGS_FIELDS,
  type Timings,
  type Tool,
  type ToolCall,
  type Usage,
} from "./types";

/** The tool options of a turn (`session.generate()`'s `tools`, `toolChoice`, `parallelToolCalls`). */
export interface ToolOptions {
  /** Functions the model may call this turn. */
  tools?: readonly Tool[];
  /** `"auto"` (the default with tools), `"none"`, `"required"`, or a tool's name. */
  toolChoice?: string;
  /** Default true (up to 8 calls per reply); false: one. */
  parallelToolCalls?: boolean;
}

// --------------------------------------------------------------------------- routing

/** The routing key of a session id: its part before the first dot. */
export function routingKey(sessionId: string): string {
  return sessionId.split(".", 1)[0] ?? sessionId;
}

/** Ray Serve's own RPC on its gRPC proxy; it needs no `application` metadata. */
export const LIST_APPLICATIONS_METHOD = "/ray.serve.RayServeAPIService/ListApplications";

/** What the server accepts as `CreateSessionRequest.session_key`. */
export const SESSION_KEY_PATTERN = /^[A-Za-z0-9_-]{8,64}$/;

/**
 * A fresh routing key for `CreateSessionRequest.session_key`.
 *
 * Chosen client-side so the session's identity exists before routing: the router hashes it,
 * so CreateSession lands on the replica that will serve every later call (22 chars of
 * `[A-Za-z0-9_-]`, 128 random bits, so keys never collide in practice).
 */
export function newSessionKey(): string {
  return randomBytes(16).toString("base64url");
}

/** `ListApplicationsRequest` on the wire (generated from protos/hotloop/v1/serve_proxy.proto). */
export function encodeListApplications(request: ListApplicationsRequest): Buffer {
  return Buffer.from(ListApplicationsRequest.encode(request).finish());
}

/**
 * The application names of Ray Serve's `ListApplicationsResponse`, decoded by the code
 * generated from protos/hotloop/v1/serve_proxy.proto (wire-compatible with Ray's message),
 * so the SDK needs none of Ray's protos.
 */
export function decodeApplicationNames(data: Uint8Array): string[] {
  return ListApplicationsResponse.decode(data).applicationNames;
}

// --------------------------------------------------------------------------- metadata

/**
 * The metadata of one call.
 *
 * `application` is how Ray Serve's gRPC proxy picks the app, and each model is its own app
 * named after the model. A session's calls send its routing key as `session_id`, which the
 * proxy hands to the session-affinity router (so the router never decodes a request to find
 * it). The bearer token rides along.
 */
export function callMetadata(
  application: string | undefined,
  token: string | undefined,
  sessionKey?: string,
): Metadata {
  const md = new Metadata();
  if (application) md.set("application", application);
  if (sessionKey) md.set("session_id", sessionKey);
  if (token) md.set("authorization", `Bearer ${token}`);
  return md;
}

// --------------------------------------------------------------------------- retries

/** One try and up to five retries of a failover (a replica or Ray's proxy restarting), spaced
 * by `backoffMs`: about 3 to 6 s of retrying in all at the default `retryDelayMs`, the time a
 * replica or the proxy takes to come back; a longer outage is reported, not hidden. */
export const MAX_ATTEMPTS = 6;

/** The longest pause between two attempts. */
export const MAX_RETRY_DELAY_MS = 3200;

/** The deadline of a unary call (retries included) when neither the call nor the client sets
 * one: a server that stopped answering fails the call instead of hanging it. */
export const DEFAULT_UNARY_TIMEOUT_MS = 30_000;

/**
 * The pause after failed attempt `attempt` (1, 2, ...): `retryDelayMs` doubled per attempt,
 * capped at `MAX_RETRY_DELAY_MS`, half of it random (equal jitter), so clients cut off by the
 * same restart do not all come back at the same instant.
 */
export function backoffMs(retryDelayMs: number, attempt: number, random: () => number = Math.random): number {
  const full = Math.min(MAX_RETRY_DELAY_MS, retryDelayMs * 2 ** (attempt - 1));
  return full / 2 + (random() * full) / 2;
}

/** Ray Serve's gRPC proxy's NOT_FOUND for an application it does not (yet) route to. */
const APP_NOT_FOUND = "not found. Ping /ray.serve.RayServeAPIService/ListApplications";

const ACTOR_DIED_MARKERS = [
  "actor died",
  "actordiederror",
  "rayactorerror",
  "replica",
  "actor is temporarily unavailable", // its node was lost (ActorUnavailableError)
  "may or may not have been executed on the actor", // the same, over the gRPC transport
];

/**
 * Whether a failure means "the replica went away", so the same request may be re-sent.
 *
 * UNAVAILABLE is the transport's word for it; Ray Serve's proxy reports a replica that died
 * mid-request as INTERNAL with the Ray exception's text, so INTERNAL counts only when its
 * details say so (a genuine server bug must not be retried silently).
 */
export function isFailover(code: Status, details: string): boolean {
  if (code === Status.UNAVAILABLE) return true;
  if (code === Status.INTERNAL) {
    const lowered = details.toLowerCase();
    return ACTOR_DIED_MARKERS.some((marker) => lowered.includes(marker));
  }
  // Ray's proxy, up before the model's application is (the server is starting or restarting):
  // the model is there seconds later. A model that does not exist costs MAX_ATTEMPTS retries;
  // hotloop-serve's own NOT_FOUND carries rich details and never reaches here.
  if (code === Status.NOT_FOUND) return details.includes(APP_NOT_FOUND);
  return false;
}

/**
 * Whether the same request may be re-sent after `err`. hotloop-serve says so itself in its rich
 * status (`RetryInfo`; its errors always carry an `ErrorInfo`, so one without `RetryInfo` is not
 * retried, whatever its text says). Errors without rich details come from gRPC or from Ray's
 * proxy (a replica that died): for those, `isFailover` decides from the code and Ray's wording.
 */
export function retriable(err: unknown): boolean {
  const rich = richDetails(err);
  if (rich.retryDelayMs !== undefined) return true;
  if (rich.reason !== undefined) return false;
  return isFailover(...statusOf(err));
}

/** Unary RPCs are idempotent, so a retriable error is retried (up to `MAX_ATTEMPTS` attempts). */
export function shouldRetryUnary(err: unknown, attempt: number): boolean {
  return attempt < MAX_ATTEMPTS && isStatusError(err) && retriable(err);
}

/**
 * The state of one Generate turn across its attempts.
 *
 * Before any text reached the caller, a failover error is invisible to them: re-send the
 * request. After text was delivered, a silent retry would repeat or contradict it, so the
 * caller gets `TurnInterrupted` with what they already have.
 */
export class StreamProgress {
  attempts = 1;
  chunks = 0;
  readonly parts: string[] = [];

  /** Record a chunk just handed to the caller. */
  delivered(chunk: Chunk): void {
    this.chunks += 1;
    if (chunk.text) this.parts.push(chunk.text);
  }

  /**
   * Whether a direct call (`direct: true`) that failed with `err` should be sent again through
   * the proxy, at once and without counting an attempt: RESOURCE_EXHAUSTED before any chunk. A
   * replica's direct ingress refuses calls past its bound (`server.direct_max_streams`, reason
   * `DIRECT_INGRESS_FULL`) that way: the replica is healthy, only full on that path, so it is not
   * avoided (`DirectRoutes.failed`); the proxy's router, which counts the replica's slots, places
   * the turn. Any other exhaustion (the engine's queue, a quota) the proxy reports again.
   */
  directRefused(err: unknown): boolean {
    return this.chunks === 0 && isStatusError(err) && statusOf(err)[0] === Status.RESOURCE_EXHAUSTED;
  }

  /** Whether to start another attempt after `err` (and count it). */
  shouldRetry(err: unknown): boolean {
    if (!isStatusError(err)) return false;
    if (this.parts.length > 0 || this.attempts >= MAX_ATTEMPTS || !retriable(err)) return false;
    this.attempts += 1;
    return true;
  }

  /** The SDK error to throw for `err` when not retrying (non-gRPC errors pass through). */
  error(err: unknown): unknown {
    if (!isStatusError(err)) return err;
    const [code, details] = statusOf(err);
    if (this.parts.length > 0 && retriable(err)) {
      return new TurnInterrupted(details, this.parts.join(""), code, { cause: err });
    }
    return fromRpcError(err);
  }
}

// --------------------------------------------------------------------------- conversions

const ROLE_TO_PROTO: Record<Role, pbc.Role> = {
  system: pbc.Role.ROLE_SYSTEM,
  user: pbc.Role.ROLE_USER,
  assistant: pbc.Role.ROLE_ASSISTANT,
  tool: pbc.Role.ROLE_TOOL,
};

const FINISH_FROM_PROTO: Partial<Record<pbc.FinishReason, FinishReason>> = {
  [pbc.FinishReason.FINISH_REASON_EOS]: "eos",
  [pbc.FinishReason.FINISH_REASON_LENGTH]: "length",
  [pbc.FinishReason.FINISH_REASON_STOP]: "stop",
  [pbc.FinishReason.FINISH_REASON_CONTEXT]: "context",
  [pbc.FinishReason.FINISH_REASON_TOOL_CALLS]: "tool_calls",
};

/** Normalise one history item; a bad role throws `TypeError` before any RPC. */
export function asMessage(item: unknown): Message {
  let role: unknown;
  let content: unknown;
  let toolCalls: unknown;
  let toolCallId: unknown;
  if (Array.isArray(item)) {
    [role, content] = item as unknown[];
  } else if (item !== null && typeof item === "object") {
    ({ role, content, toolCalls, toolCallId } = item as {
      role?: unknown;
      content?: unknown;
      toolCalls?: unknown;
      toolCallId?: unknown;
    });
  } else {
    throw new TypeError(`a history item must be {role, content} or [role, content], got ${String(item)}`);
  }
  const normalized = typeof role === "string" ? role.toLowerCase() : role;
  if (typeof normalized !== "string" || !(normalized in ROLE_TO_PROTO)) {
    throw new TypeError(`unknown role ${JSON.stringify(role)}: use "system", "user", "assistant" or "tool"`);
  }
  if (typeof content !== "string") {
    throw new TypeError(`message content must be a string, got ${typeof content}`);
  }
  if (toolCalls !== undefined && !Array.isArray(toolCalls)) {
    throw new TypeError("toolCalls must be an array of {id, name, arguments}");
  }
  if (toolCallId !== undefined && typeof toolCallId !== "string") {
    throw new TypeError(`toolCallId must be a string, got ${typeof toolCallId}`);
  }
  return {
    role: normalized as Role,
    content,
    ...(toolCalls !== undefined && { toolCalls: toolCalls as ToolCall[] }),
    ...(toolCallId !== undefined && { toolCallId }),
  };
}

/** Tools as `hotloop.v1.Tool` protos (an object schema as JSON text). */
export function toolsToProto(tools: readonly Tool[]): pbc.Tool[] {
  return tools.map((t) => ({
    name: t.name,
    description: t.description ?? "",
    parameters:
      t.parameters === undefined ? "" : typeof t.parameters === "string" ? t.parameters : JSON.stringify(t.parameters),
  }));
}

/**
 * The assistant message a streamed reply makes (its text and its calls joined), to append to
 * the history before one `"tool"` message per call's result.
 */
export function assistantMessage(chunks: Iterable<Chunk>): Message {
  let content = "";
  const calls = new Map<number, { id: string; name: string; arguments: string }>();
  for (const chunk of chunks) {
    content += chunk.text;
    for (const d of chunk.toolCalls) {
      const call = calls.get(d.index) ?? { id: d.id, name: d.name, arguments: "" };
      call.arguments += d.arguments;
      calls.set(d.index, call);
    }
  }
  const toolCalls = [...calls.entries()].sort(([a], [b]) => a - b).map(([, c]) => c);
  return { role: "assistant", content, ...(toolCalls.length > 0 && { toolCalls }) };
}

/** Messages (or pairs) as `hotloop.v1.Message` protos. */
export function messagesToProto(history: HistoryLike): pbc.Message[] {
  return Array.from(history, (item) => {
    const m = asMessage(item);
    return {
      role: ROLE_TO_PROTO[m.role],
      content: m.content,
      toolCalls: (m.toolCalls ?? []).map((c) => ({ id: c.id, name: c.name, arguments: c.arguments })),
      toolCallId: m.toolCallId ?? "",
    };
  });
}

/** Rounds a float32 read off the wire to float32's precision (7 significant digits), so that
 * `{temperature: 0.7}` survives a round trip equal to itself. */
function fromFloat32(value: number): number {
  return Number.isFinite(value) ? Number.parseFloat(value.toPrecision(7)) : value;
}

function seedToProto(seed: number | bigint): bigint {
  if (typeof seed === "number" && !Number.isSafeInteger(seed)) {
    throw new TypeError(`seed must be an integer, got ${seed}`);
  }
  const value = BigInt(seed);
  if (value < 0n || value >= 1n << 64n) throw new RangeError(`seed must be in [0, 2^64), got ${value}`);
  return value;
}

/** `Settings` as `hotloop.v1.Settings`: unset fields stay absent on the wire. */
export function settingsToProto(settings: Settings): pbc.Settings {
  return {
    temperature: settings.temperature,
    sampleLen: settings.sampleLen,
    seed: settings.seed === undefined ? undefined : seedToProto(settings.seed),
    topP: settings.topP,
    topK: settings.topK,
    repeatPenalty: settings.repeatPenalty,
    repeatLastN: settings.repeatLastN,
    stop: settings.stop ? [...settings.stop] : [],
    minP: settings.minP,
    truncateHistory: settings.truncateHistory,
    grammar: settings.grammar,
    jsonSchema: settings.jsonSchema,
    logprobs: settings.logprobs,
    topLogprobs: settings.topLogprobs,
  };
}

/** `hotloop.v1.Settings` as `Settings` (absent fields stay absent). */
export function settingsFromProto(pb: pbc.Settings): Settings {
  const out: { -readonly [K in keyof Settings]: Settings[K] } = {};
  if (pb.temperature !== undefined) out.temperature = fromFloat32(pb.temperature);
  if (pb.sampleLen !== undefined) out.sampleLen = pb.sampleLen;
  if (pb.seed !== undefined) out.seed = pb.seed <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(pb.seed) : pb.seed;
  if (pb.topP !== undefined) out.topP = fromFloat32(pb.topP);
  if (pb.topK !== undefined) out.topK = pb.topK;
  if (pb.repeatPenalty !== undefined) out.repeatPenalty = fromFloat32(pb.repeatPenalty);
  if (pb.repeatLastN !== undefined) out.repeatLastN = pb.repeatLastN;
  if (pb.stop.length > 0) out.stop = [...pb.stop];
  if (pb.minP !== undefined) out.minP = fromFloat32(pb.minP);
  if (pb.truncateHistory !== undefined) out.truncateHistory = pb.truncateHistory;
  if (pb.grammar !== undefined) out.grammar = pb.grammar;
  if (pb.jsonSchema !== undefined) out.jsonSchema = pb.jsonSchema;
  if (pb.logprobs !== undefined) out.logprobs = pb.logprobs;
  if (pb.topLogprobs !== undefined) out.topLogprobs = pb.topLogprobs;
  return out;
}

/** A copy of `settings` with only the known fields that are set (`undefined` and `stop: []` dropped). */
export function cleanSettings(settings: Settings): Settings {
  const out: Record<string, unknown> = {};
  for (const name of SETTINGS_FIELDS) {
    const value = settings[name];
    if (value === undefined) continue;
    if (name === "stop") {
      // An empty list is "not set", as on the wire (a repeated field has no presence).
      if ((value as readonly string[]).length > 0) out[name] = [...(value as readonly string[])];
    } else {
      out[name] = value;
    }
  }
  return out as Settings;
}

/** These settings with every field that `overrides` sets replacing ours. */
export function mergeSettings(base: Settings, overrides: Settings): Settings {
  return cleanSettings({ ...cleanSettings(base), ...cleanSettings(overrides) });
}

/** Whether no field of `settings` is set. */
export function isEmptySettings(settings: Settings): boolean {
  return Object.keys(cleanSettings(settings)).length === 0;
}

export function usageFromProto(pb: pbc.Usage): Usage {
  return {
    promptTokens: pb.promptTokens,
    cachedTokens: pb.cachedTokens,
    restoredTokens: pb.restoredTokens,
    prefilledTokens: pb.prefilledTokens,
    completionTokens: pb.completionTokens,
  };
}

export function timingsFromProto(pb: pbc.Timings): Timings {
  return {
    queueMs: pb.queueMs,
    prefillMs: pb.prefillMs,
    timeToFirstTokenMs: pb.timeToFirstTokenMs,
    decodeMs: pb.decodeMs,
  };
}

export function servedByFromProto(pb: pbc.ServedBy): ServedBy {
  return { replica: pb.replica, replicaRank: pb.replicaRank, cacheHit: pb.cacheHit };
}

/** `GenerateChunk` as `Chunk`; the last-chunk fields are `undefined` when absent. */
export function chunkFromProto(pb: pbs.GenerateChunk): Chunk {
  const finishReason = FINISH_FROM_PROTO[pb.finishReason];
  const usage = pb.usage ? usageFromProto(pb.usage) : undefined;
  return {
    text: pb.text,
    ...(finishReason !== undefined && { finishReason }),
    ...(usage !== undefined && { usage }),
    ...(pb.timings && { timings: timingsFromProto(pb.timings) }),
    ...(pb.servedBy && { servedBy: servedByFromProto(pb.servedBy) }),
    logprobs: pb.logprobs.map((lp) => ({
      token: lp.token,
      piece: new Uint8Array(lp.piece),
      logprob: lp.logprob,
      top: lp.top.map((t) => ({ token: t.token, piece: new Uint8Array(t.piece), logprob: t.logprob })),
    })),
    toolCalls: pb.toolCalls.map((d) => ({ index: d.index, id: d.id, name: d.name, arguments: d.arguments })),
    isLast: finishReason !== undefined || usage !== undefined,
  };
}

export function modelInfoFromProto(pb: pbm.ModelInfo): ModelInfo {
  return {
    name: pb.name,
    architecture: pb.architecture,
    contextLength: pb.contextLength,
    trainContextLength: pb.trainContextLength,
    quantization: pb.quantization,
    hasChatTemplate: pb.hasChatTemplate,
    chatTemplateSource: pb.chatTemplateSource,
    parameters: Number(pb.parameters),
    sizeBytes: Number(pb.sizeBytes),
    vocabSize: pb.vocabSize,
    replicas: pb.replicas,
  };
}

export function sessionInfoFromProto(pb: pbs.Session): SessionInfo {
  return {
    id: pb.id,
    model: pb.model,
    settings: pb.settings ? settingsFromProto(pb.settings) : {},
    contextTokens: pb.contextTokens,
    state: pb.state,
    ...(pb.servedBy && { servedBy: servedByFromProto(pb.servedBy) }),
    lastUsed: pb.lastUsedUnix,
  };
}

// --------------------------------------------------------------------------- session state

/**
 * What a session object knows locally: its server id, model and current settings.
 *
 * The settings are kept here and sent with every request, because the server's session is a
 * cache that may be rebuilt on another replica that never saw CreateSession.
 */
export class SessionState {
  closed = false;

  constructor(
    readonly id: string,
    readonly model: string,
    public settings: Settings,
  ) {}

  /** Adopt the settings the server reports (every field filled in), else what we sent. */
  apply(pb: pbs.Session, sent: Settings): void {
    if (pb.settings) {
      const reported = settingsFromProto(pb.settings);
      if (!isEmptySettings(reported)) {
        this.settings = reported;
        return;
      }
    }
    this.settings = cleanSettings(sent);
  }

  /** The session's settings with per-turn overrides. */
  turnSettings(overrides: Settings): Settings {
    return mergeSettings(this.settings, overrides);
  }

  generateRequest(history: HistoryLike, overrides: Settings, tools: ToolOptions = {}): pbs.GenerateRequest {
    const messages = messagesToProto(history);
    if (messages.length === 0) throw new TypeError("history is empty: send at least one message");
    return {
      sessionId: this.id,
      messages,
      settings: settingsToProto(this.turnSettings(overrides)),
      tools: toolsToProto(tools.tools ?? []),
      toolChoice: tools.toolChoice ?? "",
      ...(tools.parallelToolCalls !== undefined && { parallelToolCalls: tools.parallelToolCalls }),
    };
  }

  warmupRequest(history: HistoryLike): pbs.WarmupRequest {
    return { sessionId: this.id, messages: messagesToProto(history), settings: settingsToProto(this.settings) };
  }
}

// --------------------------------------------------------------------------- session operations

/** Normalised messages of a history (a bad item throws `TypeError`). */
export function asMessages(history: HistoryLike): Message[] {
  return Array.from(history, asMessage);
}

/**
 * The history to send to regenerate its last reply: everything before the final assistant
 * message (the server reuses the cache up to there).
 */
export function withoutLastReply(history: HistoryLike): Message[] {
  const messages = asMessages(history);
  if (messages.length === 0 || messages[messages.length - 1]?.role !== "assistant") {
    throw new TypeError("the history does not end with an assistant reply to regenerate");
  }
  return messages.slice(0, -1);
}

/**
 * The history to send after editing message `index` (negative counts from the end): it,
 * changed, and everything before it. What followed belonged to the old branch; the server
 * reuses the cache exactly up to the first token that differs.
 */
export function withMessageReplaced(history: HistoryLike, index: number, content: string): Message[] {
  const messages = asMessages(history);
  if (!Number.isInteger(index) || index < -messages.length || index >= messages.length) {
    throw new RangeError(`message ${index} is not in a history of ${messages.length}`);
  }
  const at = index < 0 ? index + messages.length : index;
  const old = messages[at] as Message;
  return [...messages.slice(0, at), { role: old.role, content }];
}

/** Size of each ImportSession part (the server accepts up to 1 MiB per part). */
export const IMPORT_PART_BYTES = 1 << 20;

/** An exported blob as the ordered ImportSession parts, all with the same routing key. */
export function importRequests(
  model: string,
  key: string,
  data: Uint8Array,
  settings: Settings | undefined,
): pbs.ImportSessionRequest[] {
  const proto = settings === undefined ? undefined : settingsToProto(settings);
  const blob = Buffer.from(data.buffer, data.byteOffset, data.byteLength); // a view, no copy
  const out: pbs.ImportSessionRequest[] = [];
  for (let offset = 0; offset < blob.length || out.length === 0; offset += IMPORT_PART_BYTES) {
    out.push({
      model,
      sessionKey: key,
      settings: proto,
      data: blob.subarray(offset, offset + IMPORT_PART_BYTES),
      offset: BigInt(offset),
      totalBytes: BigInt(data.length),
    });
  }
  return out;
}

/** A ForkSession request: the fork keeps `history`'s prefix of the cache (all when empty). */
export function forkRequest(
  sessionId: string,
  history: HistoryLike | undefined,
  settings: Settings,
  key: string,
): pbs.ForkSessionRequest {
  return {
    sessionId,
    messages: messagesToProto(history ?? []),
    settings: settingsToProto(settings),
    sessionKey: key,
  };
}

export function createSessionRequest(model: string, settings: Settings, key: string): pbs.CreateSessionRequest {
  return { model, settings: settingsToProto(settings), sessionKey: key };
}

/** Whether `err` is an SDK error (re-exported for the client's `catch` clauses). */
export function isHotloopError(err: unknown): err is HotloopError {
  return err instanceof HotloopError;
}

// --------------------------------------------------------------------------- direct ingress

/** The one hash of a session's key over replica ranks this client knows (`ListReplicas.routing`). */
export const DIRECT_ROUTING = "rendezvous-blake2b-v1";
/** How long a replica whose direct call failed is left to the proxy's routing (ms). */
export const AVOID_MS = 10_000;

function rendezvousScore(key: string, rank: number): string {
  // 8 bytes, big-endian, as fixed-width hex: comparing the strings compares the numbers.
  return Buffer.from(blake2b(Buffer.from(`${key}\0${rank}`, "utf8"), undefined, 8)).toString("hex");
}

/**
 * The rank owning routing key `key`: rendezvous hashing, the highest `blake2b(key "\0" rank)`
 * (8 bytes) wins, as the server's session-affinity router computes it, so a turn sent
 * directly lands where the proxy would send it.
 */
export function ownerRank(key: string, ranks: Iterable<number>): number {
  let best: number | undefined;
  let bestScore = "";
  for (const rank of ranks) {
    const score = rendezvousScore(key, rank);
    if (best === undefined || score > bestScore) {
      best = rank;
      bestScore = score;
    }
  }
  if (best === undefined) throw new RangeError("ownerRank: no ranks");
  return best;
}

/**
 * One model's replicas and their own gRPC servers (`ListReplicas`), for `direct: true` (the
 * twin of the Python SDK's `DirectRoutes`). A session's turns go to the replica owning its
 * key; where its address is unknown, the list is older than the server's `refreshS`, or a
 * direct call to that replica failed lately, they go through the proxy. A wrong guess is only
 * slower: the replica reached fetches the session's cache from its owner.
 */
export class DirectRoutes {
  private readonly addresses = new Map<number, string>();
  private expires: number;
  private readonly avoid = new Map<string, number>();

  constructor(response: pbm.ListReplicasResponse | undefined, now: number) {
    const known = response !== undefined && response.routing === DIRECT_ROUTING;
    if (known) for (const r of response.replicas) this.addresses.set(r.rank, r.address);
    this.expires = now + (known ? Math.max(response.refreshS, 1) * 1000 : 30_000);
  }

  stale(now: number): boolean {
    return now >= this.expires;
  }

  /** The owner's direct address, or undefined for the proxy. */
  addressFor(key: string, now: number): string | undefined {
    if (this.addresses.size === 0) return undefined;
    const address = this.addresses.get(ownerRank(key, this.addresses.keys()));
    if (!address || (this.avoid.get(address) ?? 0) > now) return undefined;
    return address;
  }

  /** Keep the replicas `older` was told to avoid (a fresh list may still name them). */
  inherit(older: DirectRoutes): void {
    for (const [address, until] of older.avoid) this.avoid.set(address, until);
  }

  /** A direct call to `address` failed as a failover would: the proxy routes its sessions for
   * a while, and the list is asked for again. */
  failed(address: string, now: number): void {
    this.avoid.set(address, now + AVOID_MS);
    this.expires = Math.min(this.expires, now);
  }
}
