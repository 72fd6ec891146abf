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
  Unavailable,
} from "../src";
import * as base from "../src/base";
import type * as pbs from "../src/gen/hotloop/v1/session";
import { encodeApplicationNames, FakeServer } from "./fake-server";

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
    assert.ok(base.isFailover(Status.INTERNAL, "RayActorError: ..."));
    assert.ok(base.isFailover(Status.INTERNAL, "the actor died"));
    assert.ok(!base.isFailover(Status.INTERNAL, "KeyError: 'x'"));
    assert.ok(!base.isFailover(Status.NOT_FOUND, "actor died"));
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
    });
    assert.equal(chunk.logprobs.length, 1);
    assert.equal(new TextDecoder().decode(chunk.logprobs[0]!.piece), "Hi");
    assert.equal(chunk.logprobs[0]!.top[0]!.logprob, -0.5);
  });

  test("history items: objects or pairs, roles case-insensitive, bad ones rejected", () => {
    assert.deepEqual(base.messagesToProto([{ role: "system", content: "s" }, ["user", "u"]]), [
      { role: 1, content: "s" },
      { role: 2, content: "u" },
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
