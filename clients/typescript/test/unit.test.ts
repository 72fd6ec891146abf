/**
 * Unit tests: the wire contract without Ray. Pure functions (decoding, settings, errors) and
 * the client against an in-process grpc-js server with scripted failures (test/fake-server.ts).
 */

import assert from "node:assert/strict";
import { after, before, beforeEach, describe, test } from "node:test";

import {
  Cancelled,
  type Chunk,
  Client,
  DeadlineExceeded,
  errorForStatus,
  FailedPrecondition,
  HotloopError,
  InternalError,
  InvalidArgument,
  NotFound,
  OutOfRange,
  PermissionDenied,
  ResourceExhausted,
  Status,
  TurnInterrupted,
  Unauthenticated,
  IMPORT_PART_BYTES,
  type MessageLike,
  Unavailable,
  withMessageReplaced,
  withoutLastReply,
} from "../src";
import * as grpc from "@grpc/grpc-js";

import * as base from "../src/base";
import * as errors from "../src/errors";
import type { Any } from "../src/gen/google/protobuf/any";
import { BadRequest, ErrorInfo, RetryInfo } from "../src/gen/google/rpc/error_details";
import { Status as RpcStatus } from "../src/gen/google/rpc/status";
import * as pbc from "../src/gen/hotloop/v1/common";
import type * as pbs from "../src/gen/hotloop/v1/session";
import { encodeApplicationNames, FakeServer, patternBlob } from "./fake-server";

async function collect(stream: AsyncIterable<Chunk>): Promise<Chunk[]> {
  const out: Chunk[] = [];
  for await (const chunk of stream) out.push(chunk);
  return out;
}

describe("wire helpers", () => {
  test("ListApplications replies decode with the generated codec, other fields skipped", () => {
    // encodeApplicationNames writes Ray's message by hand (plus an unknown varint field).
    assert.deepEqual(base.decodeApplicationNames(encodeApplicationNames(["gemma-3-270m", "gemma-duo"])), [
      "gemma-3-270m",
      "gemma-duo",
    ]);
    assert.deepEqual(base.decodeApplicationNames(new Uint8Array()), []);
    // fixed64 (field 3), fixed32 (field 4) and a non-ASCII name.
    const mixed = Buffer.concat([
      Buffer.from([0x19, 1, 2, 3, 4, 5, 6, 7, 8, 0x25, 1, 2, 3, 4]),
      encodeApplicationNames(["modèle"], false),
    ]);
    assert.deepEqual(base.decodeApplicationNames(mixed), ["modèle"]);
    assert.throws(() => base.decodeApplicationNames(Buffer.from([0x0a, 5, 0x61])));
    assert.throws(() => base.decodeApplicationNames(Buffer.from([0x08, 0x80])));
    assert.equal(base.encodeListApplications({}).length, 0);
  });

  test("session keys are fresh, 22 chars of [A-Za-z0-9_-]", () => {
    const keys = new Set(Array.from({ length: 200 }, () => base.newSessionKey()));
    assert.equal(keys.size, 200);
    for (const key of keys) {
      assert.match(key, base.SESSION_KEY_PATTERN);
      assert.equal(key.length, 22);
    }
  });

  test("metadata: application and bearer token", () => {
    const md = base.callMetadata("gemma-3-270m", "s3cret").getMap();
    assert.deepEqual(md, { application: "gemma-3-270m", authorization: "Bearer s3cret" });
    assert.deepEqual(base.callMetadata(undefined, undefined).getMap(), {});
  });

  test("failover: UNAVAILABLE, or INTERNAL that says a Ray actor died", () => {
    assert.ok(base.isFailover(Status.UNAVAILABLE, ""));
    assert.ok(base.isFailover(Status.INTERNAL, "ray.exceptions.ActorDiedError: The actor died unexpectedly"));
    assert.ok(base.isFailover(Status.INTERNAL, "The actor 4db3 is unavailable: The actor is temporarily unavailable"));
    assert.ok(
      base.isFailover(
        Status.INTERNAL,
        "The actor 0170 is unavailable: Actor is unavailable.. The task may or may not have been executed on the actor.",
      ),
    );
    assert.ok(base.isFailover(Status.INTERNAL, "RayActorError: ..."));
    assert.ok(base.isFailover(Status.INTERNAL, "the actor died"));
    assert.ok(!base.isFailover(Status.INTERNAL, "KeyError: 'x'"));
    assert.ok(!base.isFailover(Status.NOT_FOUND, "actor died"));
    // Ray's proxy while the model's application deploys (a server starting or restarting)
    const starting = "Application 'm' not found. Ping /ray.serve.RayServeAPIService/ListApplications for available applications.";
    assert.ok(base.isFailover(Status.NOT_FOUND, starting));
    assert.ok(!base.isFailover(Status.CANCELLED, ""));
  });

  test("settings: unset fields stay absent, float32 values round-trip, overrides merge", () => {
    const pb = base.settingsToProto({ temperature: 0.7, seed: 42, stop: ["\n"] });
    assert.equal(pb.temperature, 0.7);
    assert.equal(pb.seed, 42n);
    assert.equal(pb.sampleLen, undefined);
    assert.deepEqual(pb.stop, ["\n"]);
    // As read back off the wire (float32): 0.699999988079071 -> 0.7.
    const back = base.settingsFromProto({ ...pb, temperature: Math.fround(0.7) });
    assert.deepEqual(back, { temperature: 0.7, seed: 42, stop: ["\n"] });
    assert.equal(base.settingsFromProto({ stop: [], seed: 2n ** 63n }).seed, 2n ** 63n);
    assert.deepEqual(base.mergeSettings({ temperature: 0.5, sampleLen: 8 }, { temperature: 0, topK: undefined }), {
      temperature: 0,
      sampleLen: 8,
    });
    assert.ok(base.isEmptySettings({ temperature: undefined, stop: [] }));
    assert.ok(!base.isEmptySettings({ truncateHistory: false }));
    assert.throws(() => base.settingsToProto({ seed: -1 }), RangeError);
    assert.throws(() => base.settingsToProto({ seed: 1.5 }), TypeError);
  });

  test("tools go with the turn; calls come back as deltas and join into the assistant message", () => {
    const state = new base.SessionState("key-1.sig", "m", { temperature: 0.5 });
    const tool = { name: "f", description: "a function", parameters: { type: "object" } };
    const options = { tools: [tool], toolChoice: "f", parallelToolCalls: false };
    const request = state.generateRequest([["user", "hi"]], {}, options);
    assert.deepEqual(request.tools, [{ name: "f", description: "a function", parameters: '{"type":"object"}' }]);
    assert.equal(request.toolChoice, "f");
    assert.equal(request.parallelToolCalls, false);
    const plain = state.generateRequest([["user", "hi"]], {});
    assert.deepEqual([plain.tools, plain.toolChoice, plain.parallelToolCalls], [[], "", undefined]);
    const delta = (index: number, id: string, name: string, args: string) =>
      base.chunkFromProto({
        text: "",
        finishReason: 0,
        usage: undefined,
        timings: undefined,
        servedBy: undefined,
        logprobs: [],
        toolCalls: [{ index, id, name, arguments: args }],
      });
    const reply = base.assistantMessage([delta(0, "call_1", "f", '{"a"'), delta(0, "", "", ": 1}")]);
    const call = { id: "call_1", name: "f", arguments: '{"a": 1}' };
    assert.deepEqual(reply, { role: "assistant", content: "", toolCalls: [call] });
    const sent = base.messagesToProto([reply, { role: "tool", content: "2", toolCallId: "call_1" }]);
    assert.equal(sent[0]!.toolCalls[0]!.arguments, '{"a": 1}');
    assert.deepEqual([sent[1]!.role, sent[1]!.toolCallId], [pbc.Role.ROLE_TOOL, "call_1"]);
    assert.throws(() => base.asMessage({ role: "tool", content: "x", toolCallId: 3 }), TypeError);
  });

  test("structured output and logprobs settings round-trip; chunks carry logprobs", () => {
    const settings = { jsonSchema: '{"type": "object"}', logprobs: true, topLogprobs: 2 };
    assert.deepEqual(base.settingsFromProto(base.settingsToProto(settings)), settings);
    assert.equal(base.settingsToProto({ grammar: 'root ::= "a"' }).grammar, 'root ::= "a"');
    const piece = Buffer.from("Hi");
    const chunk = base.chunkFromProto({
      text: "Hi",
      finishReason: 0,
      usage: undefined,
      timings: undefined,
      servedBy: undefined,
      logprobs: [{ token: 7, piece, logprob: -0.5, top: [{ token: 7, piece, logprob: -0.5 }] }],
      toolCalls: [],
    });
    assert.equal(chunk.logprobs.length, 1);
    assert.equal(new TextDecoder().decode(chunk.logprobs[0]!.piece), "Hi");
    assert.equal(chunk.logprobs[0]!.top[0]!.logprob, -0.5);
  });

  test("history items: objects or pairs, roles case-insensitive, bad ones rejected", () => {
    assert.deepEqual(base.messagesToProto([{ role: "system", content: "s" }, ["user", "u"]]), [
      { role: 1, content: "s", toolCalls: [], toolCallId: "" },
      { role: 2, content: "u", toolCalls: [], toolCallId: "" },
    ]);
    assert.deepEqual(base.asMessage(["Assistant", "a"] as unknown), { role: "assistant", content: "a" });
    assert.throws(() => base.asMessage(["robot", "x"] as unknown), /unknown role/);
    assert.throws(() => base.asMessage({ role: "user" } as unknown), TypeError);
  });

  test("statuses become the error tree", () => {
    const cases: [Status, new (...a: never[]) => HotloopError][] = [
      [Status.INVALID_ARGUMENT, InvalidArgument],
      [Status.NOT_FOUND, NotFound],
      [Status.OUT_OF_RANGE, OutOfRange],
      [Status.RESOURCE_EXHAUSTED, ResourceExhausted],
      [Status.FAILED_PRECONDITION, FailedPrecondition],
      [Status.UNAUTHENTICATED, Unauthenticated],
      [Status.PERMISSION_DENIED, PermissionDenied],
      [Status.CANCELLED, Cancelled],
      [Status.DEADLINE_EXCEEDED, DeadlineExceeded],
      [Status.UNAVAILABLE, Unavailable],
      [Status.INTERNAL, InternalError],
      [Status.UNKNOWN, InternalError],
      [Status.DATA_LOSS, InternalError],
    ];
    for (const [code, cls] of cases) {
      const err = errorForStatus(code, "why");
      assert.ok(err instanceof cls, `${Status[code]} -> ${err.name}`);
      assert.ok(err instanceof HotloopError && err instanceof Error);
      assert.equal(err.code, code);
      assert.equal(err.details, "why");
      assert.equal(err.message, `${Status[code]}: why`);
    }
    const other = errorForStatus(Status.UNIMPLEMENTED, "nope");
    assert.equal(other.constructor, HotloopError);
    assert.equal(other.codeName, "UNIMPLEMENTED");
    const interrupted = new TurnInterrupted("replica died", "Hello", Status.UNAVAILABLE);
    assert.ok(interrupted instanceof Unavailable);
    assert.equal(interrupted.partialText, "Hello");
    assert.equal(interrupted.name, "TurnInterrupted");
    assert.equal(new NotFound("x").code, Status.NOT_FOUND);
  });
});

describe("the richer error model", () => {
  /** A grpc-js ServiceError with the server's `grpc-status-details-bin` trailer. */
  function withDetails(code: Status, details: string, ...packed: Any[]): Error {
    const metadata = new grpc.Metadata();
    metadata.set(errors.DETAILS_KEY, Buffer.from(RpcStatus.encode({ code, message: details, details: packed }).finish()));
    return Object.assign(new Error(details), { code, details, metadata });
  }
  const pack = (type: string, value: Uint8Array): Any => ({
    typeUrl: `type.googleapis.com/google.rpc.${type}`,
    value: Buffer.from(value),
  });
  const info = (reason: string): Any => pack("ErrorInfo", ErrorInfo.encode({ reason, domain: "hotloop-serve", metadata: {} }).finish());

  test("reason, field violations and retry delay, without parsing text", () => {
    const bad = errors.fromRpcError(
      withDetails(
        Status.INVALID_ARGUMENT,
        "top_p must be in (0, 1]",
        info("INVALID_SETTING"),
        pack("BadRequest", BadRequest.encode({ fieldViolations: [{ field: "settings.top_p", description: "top_p must be in (0, 1]", reason: "", localizedMessage: undefined }] }).finish()),
      ),
    );
    assert.ok(bad instanceof InvalidArgument);
    assert.equal(bad.reason, "INVALID_SETTING");
    assert.deepEqual(bad.fieldViolations, [["settings.top_p", "top_p must be in (0, 1]"]]);
    assert.equal(bad.retryDelayMs, undefined);
    const retry = pack("RetryInfo", RetryInfo.encode({ retryDelay: { seconds: 1n, nanos: 500_000_000 } }).finish());
    const later = errors.fromRpcError(withDetails(Status.UNAVAILABLE, "draining", info("UNAVAILABLE"), retry));
    assert.equal(later.retryDelayMs, 1500);
  });

  test("retries follow the server's word, then Ray's wording", () => {
    const retry = pack("RetryInfo", RetryInfo.encode({ retryDelay: { seconds: 0n, nanos: 200_000_000 } }).finish());
    assert.ok(base.retriable(withDetails(Status.RESOURCE_EXHAUSTED, "queue full", info("RESOURCE_EXHAUSTED"), retry)));
    // Our own INTERNAL is a bug even if its text says "replica": never re-sent.
    assert.ok(!base.retriable(withDetails(Status.INTERNAL, "replica state corrupt", info("INTERNAL"))));
    // No rich details (gRPC itself, Ray's proxy): the code and Ray's wording decide.
    const plain = (code: Status, details: string): Error => Object.assign(new Error(details), { code, details });
    assert.ok(base.retriable(plain(Status.UNAVAILABLE, "connection refused")));
    assert.ok(base.retriable(plain(Status.INTERNAL, "ray.exceptions.ActorDiedError: gone")));
    assert.ok(!base.retriable(plain(Status.INTERNAL, "division by zero")));
    // A trailer that does not match the status is ignored.
    const lying = withDetails(Status.NOT_FOUND, "x", info("SESSION_NOT_FOUND"));
    (lying as unknown as { code: number }).code = Status.INTERNAL;
    assert.equal(errors.fromRpcError(lying).reason, undefined);
  });
});

describe("client against a scripted in-process server", () => {
  const fake = new FakeServer();
  let client: Client;

  before(async () => {
    await fake.start();
    client = new Client(fake.address, { token: "tok", retryDelayMs: 1 });
  });
  after(async () => {
    client.close();
    await fake.stop();
  });
  beforeEach(() => {
    fake.calls.length = 0;
    fake.generateScripts = [];
    fake.unaryFailures = [];
    fake.cancellations = 0;
  });

  test("listModels asks the proxy for applications, then the first application", async () => {
    const models = await client.listModels();
    assert.deepEqual(
      models.map((m) => m.name),
      ["alpha", "beta"],
    );
    assert.equal(models[0]?.parameters, 268098176);
    assert.deepEqual(
      fake.calls.map((c) => [c.method, c.metadata["application"], c.metadata["authorization"]]),
      [
        ["ListApplications", undefined, "Bearer tok"],
        ["ListModels", "alpha", "Bearer tok"],
      ],
    );
  });

  test("newSession sends a routing key and the settings; later calls use the returned id", async () => {
    const session = await client.model("alpha").newSession({ settings: { temperature: 0, sampleLen: 16 } });
    const create = fake.of("CreateSession")[0]?.request as pbs.CreateSessionRequest;
    assert.match(create.sessionKey, base.SESSION_KEY_PATTERN);
    assert.equal(create.model, "alpha");
    assert.equal(create.settings?.temperature, 0);
    assert.match(session.id, /^s\d+\.signed$/);
    // The server's filled-in settings are adopted (float32 rounded).
    assert.equal(session.settings.topP, 0.95);
    assert.equal(session.settings.sampleLen, 16);

    const chunks = await collect(session.generate([["user", "hi"]], { topK: 5 }));
    assert.equal(chunks.map((c) => c.text).join(""), "Hello world");
    const last = chunks.at(-1);
    assert.ok(last?.isLast && !chunks[0]?.isLast);
    assert.equal(last?.finishReason, "length");
    assert.equal(last?.usage?.cachedTokens, 4);
    assert.equal(last?.servedBy?.replica, "r0");
    // The routing key rides as `session_id` metadata, for the session-affinity router.
    assert.equal(fake.of("CreateSession")[0]?.metadata["session_id"], create.sessionKey);
    assert.equal(fake.of("Generate")[0]?.metadata["session_id"], session.id.split(".")[0]);

    const gen = fake.of("Generate")[0];
    const request = gen?.request as pbs.GenerateRequest;
    assert.equal(request.sessionId, session.id);
    assert.equal(gen?.metadata["application"], "alpha");
    assert.equal(gen?.metadata["authorization"], "Bearer tok");
    // The session's settings, with the per-turn override, on every turn.
    assert.equal(request.settings?.temperature, 0);
    assert.equal(request.settings?.sampleLen, 16);
    assert.equal(request.settings?.topK, 5);
    assert.equal(request.settings?.repeatLastN, 64);
    assert.equal(session.settings.topK, 40, "an override does not change the session");

    await session.warmup([{ role: "system", content: "be brief" }]);
    const warm = fake.of("Warmup")[0]?.request as pbs.WarmupRequest;
    assert.equal(warm.settings?.sampleLen, 16);

    assert.equal(await session.context(), 7);
    const updated = await session.setSettings({ temperature: 0.25, stop: ["\n\n"] });
    assert.deepEqual(updated, { temperature: 0.25, stop: ["\n\n"] });
    await collect(session.generate([["user", "hi"]]));
    const second = fake.of("Generate")[1]?.request as pbs.GenerateRequest;
    assert.deepEqual(second.settings?.stop, ["\n\n"]);
    assert.equal(second.settings?.sampleLen, undefined);
    await session.clearCache();

    await session.close();
    await session.close(); // idempotent: no second call
    assert.equal(fake.of("CloseSession").length, 1);
    for (const call of fake.calls) {
      if (call.method !== "ListApplications") assert.equal(call.metadata["application"], "alpha", call.method);
    }
  });

  test("a bad history or option throws before any call", async () => {
    const session = await client.model("alpha").newSession();
    fake.calls.length = 0;
    assert.throws(() => session.generate([]), /history is empty/);
    assert.throws(() => session.generate([["robot" as "user", "x"]]), /unknown role/);
    assert.throws(() => session.generate([["user", "x"]], { temprature: 0 } as never), /unknown generate\(\) option/);
    assert.equal(fake.calls.length, 0);
  });

  test("a stream failing with UNAVAILABLE before any text is retried", async () => {
    const session = await client.model("alpha").newSession();
    fake.generateScripts = [{ fail: { code: Status.UNAVAILABLE, details: "replica gone" } }];
    const chunks = await collect(session.generate([["user", "hi"]]));
    assert.equal(chunks.map((c) => c.text).join(""), "Hello world");
    assert.equal(fake.of("Generate").length, 2);
  });

  test("INTERNAL 'ActorDiedError' is retried; a plain INTERNAL is not", async () => {
    const session = await client.model("alpha").newSession();
    fake.generateScripts = [{ fail: { code: Status.INTERNAL, details: "ray.exceptions.ActorDiedError: gone" } }];
    assert.equal((await collect(session.generate([["user", "hi"]]))).length, 3);
    assert.equal(fake.of("Generate").length, 2);

    fake.calls.length = 0;
    fake.generateScripts = [{ fail: { code: Status.INTERNAL, details: "ZeroDivisionError" } }];
    await assert.rejects(collect(session.generate([["user", "hi"]])), InternalError);
    assert.equal(fake.of("Generate").length, 1);
  });

  test("at most MAX_ATTEMPTS attempts: then the failure surfaces as Unavailable", async () => {
    const session = await client.model("alpha").newSession();
    const fail = { code: Status.UNAVAILABLE, details: "down" };
    fake.generateScripts = Array.from({ length: base.MAX_ATTEMPTS + 1 }, () => ({ fail }));
    await assert.rejects(
      collect(session.generate([["user", "hi"]])),
      (err: unknown) => err instanceof Unavailable && !(err instanceof TurnInterrupted),
    );
    assert.equal(fake.of("Generate").length, base.MAX_ATTEMPTS);
  });

  test("retries back off: doubling from retryDelayMs, half jittered, capped", () => {
    const low = [1, 2, 3, 4, 5, 6, 7].map((a) => base.backoffMs(200, a, () => 0));
    const high = [1, 2, 3, 4, 5, 6, 7].map((a) => base.backoffMs(200, a, () => 1));
    assert.deepEqual(high, [200, 400, 800, 1600, 3200, 3200, 3200]);
    assert.deepEqual(low, [100, 200, 400, 800, 1600, 1600, 1600]);
  });

  test("a failure after text was delivered is TurnInterrupted with the partial text", async () => {
    const session = await client.model("alpha").newSession();
    fake.generateScripts = [
      { texts: ["Once", " upon"], fail: { code: Status.UNAVAILABLE, details: "replica died" } },
    ];
    const seen: string[] = [];
    await assert.rejects(
      (async () => {
        for await (const chunk of session.generate([["user", "hi"]])) seen.push(chunk.text);
      })(),
      (err: unknown) => {
        assert.ok(err instanceof TurnInterrupted);
        assert.equal(err.partialText, "Once upon");
        assert.equal(err.code, Status.UNAVAILABLE);
        return true;
      },
    );
    assert.deepEqual(seen, ["Once", " upon"]);
    assert.equal(fake.of("Generate").length, 1);
  });

  test("unary calls: failover retried, other errors typed", async () => {
    fake.unaryFailures = [{ code: Status.UNAVAILABLE, details: "blip" }];
    const session = await client.model("alpha").newSession();
    assert.equal(fake.of("CreateSession").length, 2);
    const keys = fake.of("CreateSession").map((c) => (c.request as pbs.CreateSessionRequest).sessionKey);
    assert.equal(keys[0], keys[1], "a retry re-sends the same routing key");

    fake.unaryFailures = [{ code: Status.RESOURCE_EXHAUSTED, details: "too many sessions" }];
    await assert.rejects(session.info(), ResourceExhausted);
    await assert.rejects(client.model("nope").info(), (err: unknown) => {
      assert.ok(err instanceof NotFound);
      assert.match(err.details, /nope/);
      return true;
    });
    await assert.rejects(client.model("alpha").session("missing.id").context(), NotFound);
    await client.model("alpha").session("missing.id").close(); // already gone: fine
  });

  test("AbortSignal cancels a stream on the server and rejects with Cancelled", async () => {
    const session = await client.model("alpha").newSession();
    fake.generateScripts = [{ texts: ["tick"], hang: true }];
    const controller = new AbortController();
    const seen: string[] = [];
    await assert.rejects(
      (async () => {
        for await (const chunk of session.generate([["user", "hi"]], { signal: controller.signal })) {
          seen.push(chunk.text);
          controller.abort();
        }
      })(),
      Cancelled,
    );
    assert.deepEqual(seen, ["tick"]);
    await fake.waitCancellations(1);
    // An already-aborted signal fails before any call.
    fake.calls.length = 0;
    await assert.rejects(collect(session.generate([["user", "hi"]], { signal: AbortSignal.abort() })), Cancelled);
    await assert.rejects(session.info({ signal: AbortSignal.abort() }), Cancelled);
    assert.equal(fake.calls.length, 0);
  });

  test("an abort while waiting on the server cancels the call", async () => {
    const session = await client.model("alpha").newSession();
    fake.generateScripts = [{ texts: [], hang: true }];
    const started = Date.now();
    await assert.rejects(
      collect(session.generate([["user", "hi"]], { signal: AbortSignal.timeout(200) })),
      (err: unknown) => err instanceof Cancelled && (err.cause as Error).name === "TimeoutError",
    );
    assert.ok(Date.now() - started < 5000);
    await fake.waitCancellations(1);
  });

  test("leaving the loop early cancels the call; timeoutMs gives DeadlineExceeded", async () => {
    const session = await client.model("alpha").newSession();
    fake.generateScripts = [{ texts: ["a", "b"], hang: true }];
    for await (const chunk of session.generate([["user", "hi"]])) {
      assert.equal(chunk.text, "a");
      break;
    }
    await fake.waitCancellations(1);
    fake.generateScripts = [{ texts: [], hang: true }];
    await assert.rejects(collect(session.generate([["user", "hi"]], { timeoutMs: 200 })), DeadlineExceeded);
  });

  test("an unreachable server is Unavailable after the retries", async () => {
    const dead = new Client("127.0.0.1:1", { retryDelayMs: 1 });
    try {
      await assert.rejects(dead.listModels({ timeoutMs: 5000 }), Unavailable);
    } finally {
      dead.close();
    }
  });
});

describe("session operations (fork, list, export, import, regenerate) against the fake server", () => {
  const fake = new FakeServer();
  let client: Client;

  before(async () => {
    await fake.start();
    client = new Client(fake.address, { token: "tok", retryDelayMs: 1 });
  });
  after(async () => {
    client.close();
    await fake.stop();
  });
  beforeEach(() => {
    fake.calls.length = 0;
    fake.unaryFailures = [];
    fake.exportShortBy = 0;
  });

  test("withoutLastReply and withMessageReplaced rewind the history client-side", () => {
    const history: MessageLike[] = [
      ["system", "be brief"],
      ["user", "hi"],
      ["assistant", "hello"],
      ["user", "more"],
      ["assistant", "sure"],
    ];
    assert.deepEqual(withoutLastReply(history), [
      { role: "system", content: "be brief" },
      { role: "user", content: "hi" },
      { role: "assistant", content: "hello" },
      { role: "user", content: "more" },
    ]);
    assert.throws(() => withoutLastReply(history.slice(0, 2)), /does not end with an assistant reply/);
    assert.throws(() => withoutLastReply([]), TypeError);
    assert.deepEqual(withMessageReplaced(history, 1, "hey"), [
      { role: "system", content: "be brief" },
      { role: "user", content: "hey" },
    ]);
    assert.deepEqual(withMessageReplaced(history, -2, "less").at(-1), { role: "user", content: "less" });
    assert.equal(withMessageReplaced(history, -2, "less").length, 4);
    assert.throws(() => withMessageReplaced(history, 5, "x"), RangeError);
    assert.throws(() => withMessageReplaced(history, -6, "x"), RangeError);
    assert.throws(() => withMessageReplaced(history, 1.5, "x"), RangeError);
  });

  test("importRequests: ordered parts of at most 1 MiB, one key, offsets and total", () => {
    const blob = patternBlob(IMPORT_PART_BYTES * 2 + 5);
    const parts = base.importRequests("alpha", "k".repeat(22), blob, { temperature: 0 });
    assert.deepEqual(
      parts.map((p) => [p.data.length, p.offset, p.totalBytes]),
      [
        [IMPORT_PART_BYTES, 0n, BigInt(blob.length)],
        [IMPORT_PART_BYTES, BigInt(IMPORT_PART_BYTES), BigInt(blob.length)],
        [5, BigInt(2 * IMPORT_PART_BYTES), BigInt(blob.length)],
      ],
    );
    assert.ok(parts.every((p) => p.sessionKey === "k".repeat(22) && p.model === "alpha"));
    assert.ok(parts.every((p) => p.settings?.temperature === 0));
    assert.deepEqual(Buffer.concat(parts.map((p) => p.data)), blob);
    // An empty blob is still one (empty) part, so the server answers; no settings: absent.
    const empty = base.importRequests("alpha", "k".repeat(22), new Uint8Array(), undefined);
    assert.equal(empty.length, 1);
    assert.equal(empty[0]?.settings, undefined);
    assert.equal(empty[0]?.totalBytes, 0n);
  });

  test("fork runs on the source's replica, under a new key, with the source's settings by default", async () => {
    const source = await client.model("alpha").newSession({ settings: { temperature: 0, sampleLen: 16 } });
    const history: MessageLike[] = [
      ["user", "hi"],
      ["assistant", "hello"],
    ];
    const fork = await source.fork(history.slice(0, 1));
    const call = fake.of("ForkSession")[0];
    const request = call?.request as pbs.ForkSessionRequest;
    assert.equal(request.sessionId, source.id);
    assert.equal(call?.metadata["session_id"], base.routingKey(source.id), "routed to the source's replica");
    assert.equal(call?.metadata["application"], "alpha");
    assert.match(request.sessionKey, base.SESSION_KEY_PATTERN);
    assert.notEqual(request.sessionKey, base.routingKey(source.id));
    assert.deepEqual(
      request.messages.map((m) => m.content),
      ["hi"],
    );
    assert.equal(request.settings?.sampleLen, 16);
    assert.notEqual(fork.id, source.id);
    assert.equal(fork.settings.sampleLen, 16);
    assert.equal(fork.model, "alpha");

    // The fork is a session of its own: its turns carry its id and routing key.
    await collect(fork.generate([["user", "hi"]]));
    const gen = fake.of("Generate")[0];
    assert.equal((gen?.request as pbs.GenerateRequest).sessionId, fork.id);
    assert.equal(gen?.metadata["session_id"], base.routingKey(fork.id));

    // Whole cache (no history: no messages) and other settings.
    const other = await source.fork(undefined, { temperature: 0.5 });
    const second = fake.of("ForkSession")[1]?.request as pbs.ForkSessionRequest;
    assert.deepEqual(second.messages, []);
    assert.equal(second.settings?.temperature, 0.5);
    assert.equal(second.settings?.sampleLen, undefined);
    assert.equal(other.settings.temperature, 0.5);

    await assert.rejects(client.model("alpha").session("gone.x").fork(), NotFound);
    fake.unaryFailures = [{ code: Status.UNAVAILABLE, details: "replica restarting" }];
    assert.ok((await source.fork()).id, "a failover is retried");
  });

  test("listSessions: every session of the model, with state, tokens and last use", async () => {
    const a = await client.model("alpha").newSession();
    const sessions = await client.model("alpha").listSessions();
    const call = fake.of("ListSessions")[0];
    assert.equal((call?.request as pbs.ListSessionsRequest).model, "alpha");
    assert.equal(call?.metadata["application"], "alpha");
    assert.equal(call?.metadata["session_id"], undefined);
    const mine = sessions.find((s) => s.id === a.id);
    assert.ok(mine, JSON.stringify(sessions));
    assert.equal(mine.state, "hot");
    assert.equal(mine.contextTokens, 7);
    assert.ok(mine.lastUsed > 1_700_000_000);
    assert.ok(mine.servedBy);
    assert.deepEqual(
      sessions.map((s) => s.lastUsed),
      [...sessions.map((s) => s.lastUsed)].sort((x, y) => y - x),
    );
  });

  test("export collects the stream; importSession sends it back in ordered 1 MiB parts, one key", async () => {
    const session = await client.model("alpha").newSession({ settings: { temperature: 0 } });
    const blob = await session.export();
    assert.ok(blob instanceof Uint8Array);
    assert.equal(blob.length, fake.exportBytes);
    assert.deepEqual(Buffer.from(blob), patternBlob(fake.exportBytes));
    const exp = fake.of("ExportSession")[0];
    assert.equal((exp?.request as pbs.ExportSessionRequest).sessionId, session.id);
    assert.equal(exp?.metadata["session_id"], base.routingKey(session.id));

    const imported = await client.model("alpha").importSession(blob, { temperature: 0, sampleLen: 8 });
    const parts = fake.of("ImportSession");
    assert.equal(parts.length, 3);
    const requests = parts.map((p) => p.request as pbs.ImportSessionRequest);
    const key = requests[0]?.sessionKey ?? "";
    assert.match(key, base.SESSION_KEY_PATTERN);
    assert.deepEqual(
      parts.map((p) => p.metadata["session_id"]),
      [key, key, key],
      "every part to the same replica",
    );
    assert.ok(requests.every((r) => r.sessionKey === key && r.model === "alpha" && r.data.length <= IMPORT_PART_BYTES));
    assert.deepEqual(
      requests.map((r) => r.offset),
      [0n, BigInt(IMPORT_PART_BYTES), BigInt(2 * IMPORT_PART_BYTES)],
    );
    assert.equal(imported.id, `${key}.signed`);
    assert.deepEqual(fake.blobs.get(imported.id), Buffer.from(blob));
    assert.equal(imported.settings.sampleLen, 8);
    await collect(imported.generate([["user", "hi"]]));
    assert.equal(fake.of("Generate")[0]?.metadata["session_id"], key);

    // Without settings: the exported session's (the server's answer) are adopted.
    const plain = await client.model("alpha").importSession(blob);
    assert.equal((fake.of("ImportSession").at(-1)?.request as pbs.ImportSessionRequest).settings, undefined);
    assert.equal(plain.settings.temperature, 0.5);
  });

  test("export and import errors are typed", async () => {
    const session = await client.model("alpha").newSession();
    await assert.rejects(client.model("alpha").session("gone.x").export(), NotFound);
    fake.exportShortBy = 10;
    await assert.rejects(session.export(), (err: unknown) => {
      assert.ok(err instanceof InternalError, String(err));
      assert.equal(err.code, Status.DATA_LOSS);
      return true;
    });
    await assert.rejects(
      client.model("alpha").importSession(Buffer.from("not an export")),
      FailedPrecondition,
    );
    fake.unaryFailures = [{ code: Status.INVALID_ARGUMENT, details: "damaged blob" }];
    await assert.rejects(client.model("alpha").importSession(patternBlob(10)), InvalidArgument);
    const controller = new AbortController();
    controller.abort();
    await assert.rejects(session.export({ signal: controller.signal }), Cancelled);
  });

  test("regenerate sends the history without its last reply", async () => {
    const session = await client.model("alpha").newSession();
    await collect(
      session.regenerate([
        ["user", "hi"],
        ["assistant", "hello"],
      ]),
    );
    const request = fake.of("Generate")[0]?.request as pbs.GenerateRequest;
    assert.deepEqual(
      request.messages.map((m) => m.content),
      ["hi"],
    );
    assert.throws(() => session.regenerate([["user", "hi"]]), /does not end with an assistant reply/);
  });
});

/** A proxy and one replica (fake servers), a `direct: true` client of the proxy, and a session both know. */
async function directPair() {
  const proxy = new FakeServer();
  const replica = new FakeServer();
  await proxy.start();
  await replica.start();
  proxy.replicaAddresses = [replica.address];
  const client = new Client(proxy.address, { direct: true, retryDelayMs: 1 });
  const session = await client.model("alpha").newSession();
  const settings = proxy.sessions.get(session.id);
  assert.ok(settings);
  replica.sessions.set(session.id, settings);
  return { proxy, replica, client, session };
}

describe("direct ingress (direct: true)", () => {
  test("ownerRank hashes a key to the owner the server's router picks", () => {
    // From hotloop_serve.serve.router.owner_of over 1, 2, 3, 5 and 8 replicas.
    const vectors: [string, number[]][] = [
      ["abcdefgh12345678", [0, 1, 1, 1, 1]],
      ["Zy-_09azAZ000000", [0, 1, 1, 1, 1]],
      ["sessionkeyXYZ123", [0, 0, 0, 0, 5]],
      ["k3y_with-dash_42", [0, 1, 1, 1, 7]],
      ["0000000000000000", [0, 1, 1, 1, 1]],
      ["hotloopDirect001", [0, 0, 0, 0, 6]],
    ];
    for (const [key, owners] of vectors) {
      const got = [1, 2, 3, 5, 8].map((n) => base.ownerRank(key, Array.from({ length: n }, (_, i) => i)));
      assert.deepEqual(got, owners, key);
    }
  });

  test("routes fall back to the proxy where they do not know, and avoid a replica that failed", () => {
    const listing = (...addresses: string[]) => ({
      model: "m",
      replicas: addresses.map((address, rank) => ({ rank, address })),
      routing: base.DIRECT_ROUTING,
      refreshS: 10,
    });
    assert.equal(new base.DirectRoutes(undefined, 0).addressFor("abcdefgh12345678", 0), undefined);
    assert.equal(new base.DirectRoutes(listing(), 0).addressFor("abcdefgh12345678", 0), undefined);
    assert.equal(new base.DirectRoutes({ ...listing("h:1"), routing: "other" }, 0).addressFor("k", 0), undefined);
    const routes = new base.DirectRoutes(listing("h:0", "h:1"), 0);
    assert.equal(routes.addressFor("abcdefgh12345678", 1), "h:1");
    assert.ok(!routes.stale(1));
    routes.failed("h:1", 1);
    assert.ok(routes.stale(1));
    const fresh = new base.DirectRoutes(listing("h:0", "h:1"), 2);
    fresh.inherit(routes);
    assert.equal(fresh.addressFor("abcdefgh12345678", 2), undefined);
    assert.equal(fresh.addressFor("abcdefgh12345678", 2 + base.AVOID_MS), "h:1");
  });

  test("a session's turns go to its replica's own server; a replica gone sends them through the proxy", async () => {
    const { proxy, replica, client, session } = await directPair();
    try {
      const first = await collect(session.generate([["user", "hi"]]));
      assert.equal(first.map((c) => c.text).join(""), "Hello world");
      assert.equal(proxy.of("ListReplicas").length, 1);
      assert.equal(proxy.of("Generate").length, 0);
      assert.equal(replica.of("Generate").length, 1);
      assert.equal(replica.of("Generate")[0]?.metadata["session_id"], session.id.split(".")[0]);

      await replica.stop();
      const second = await collect(session.generate([["user", "hi again"]]));
      assert.equal(second.map((c) => c.text).join(""), "Hello world");
      assert.equal(proxy.of("Generate").length, 1); // the detour, not an error
    } finally {
      client.close();
      await proxy.stop();
    }
  });

  test("a replica whose direct ingress is full sends that turn through the proxy, and is not avoided", async () => {
    const { proxy, replica, client, session } = await directPair();
    try {
      // What the server's direct ingress answers past server.direct_max_streams.
      const details = "this replica's direct ingress is serving its limit of 2 calls at once";
      const status = RpcStatus.encode({
        code: Status.RESOURCE_EXHAUSTED,
        message: details,
        details: [
          {
            typeUrl: "type.googleapis.com/google.rpc.ErrorInfo",
            value: Buffer.from(ErrorInfo.encode({ reason: "DIRECT_INGRESS_FULL", domain: "hotloop-serve", metadata: {} }).finish()),
          },
          {
            typeUrl: "type.googleapis.com/google.rpc.RetryInfo",
            value: Buffer.from(RetryInfo.encode({ retryDelay: { seconds: 1n, nanos: 0 } }).finish()),
          },
        ],
      }).finish();
      const metadata = new grpc.Metadata();
      metadata.set(errors.DETAILS_KEY, Buffer.from(status));
      replica.generateScripts.push({ fail: { code: grpc.status.RESOURCE_EXHAUSTED, details, metadata } });

      const full = await collect(session.generate([["user", "hi"]]));
      assert.equal(full.map((c) => c.text).join(""), "Hello world");
      assert.equal(replica.of("Generate").length, 1); // refused there...
      assert.equal(proxy.of("Generate").length, 1); // ...and answered through the proxy at once
      assert.equal(proxy.of("ListReplicas").length, 1); // the list was not distrusted

      const next = await collect(session.generate([["user", "hi again"]]));
      assert.equal(next.map((c) => c.text).join(""), "Hello world");
      assert.equal(replica.of("Generate").length, 2); // healthy, only full: tried directly again
      assert.equal(proxy.of("Generate").length, 1);
    } finally {
      client.close();
      await replica.stop();
      await proxy.stop();
    }
  });

  test("only a refusal before any chunk goes to the proxy", () => {
    const full = Object.assign(new Error("full"), { code: Status.RESOURCE_EXHAUSTED, details: "full" });
    const progress = new base.StreamProgress();
    assert.ok(progress.directRefused(full));
    assert.ok(!progress.directRefused(Object.assign(new Error("x"), { code: Status.UNAVAILABLE, details: "x" })));
    assert.ok(!progress.directRefused(new Error("not a status")));
    progress.delivered({ text: "", logprobs: [], toolCalls: [] } as unknown as Chunk); // e.g. a tool call's first delta
    assert.ok(!progress.directRefused(full)); // a chunk was delivered: never re-sent silently
    assert.equal(progress.attempts, 1);
  });

  test("direct with TLS is refused", () => {
    assert.throws(() => new Client("h:1", { direct: true, tls: true }), /plaintext/);
  });
});
