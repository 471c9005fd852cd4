"""Bad specs: each asserts the exact full text of the SpecError."""

from __future__ import annotations

import pytest

from e31.specs import Problem, SpecError, parse_spec

LIVE = (
    "such work does not belong on a batch queue and should run on local infrastructure "
    "(a service host or the machine itself); E31 accepts batch work that runs to an end "
    "with a declared output: kind training, inference, processing or simulation"
)
DURATION = "must be a duration such as 90s, 10m, 4h, 1d, 1h30m, 04:00:00 or PT4H, or a number of seconds"
FILES_FIX = "write it relative to the output folder, e.g. model.pt or plots/loss.png"
NO_OUTPUT = (
    "output: required: a job with no output has no end and is refused; add an output section, "
    "e.g. output: {kind: results, url: results/NAME/, files: [metrics.json]}, listing the files "
    "whose existence marks the job complete"
)

BASE = {
    "name": "name: job",
    "work": "work: {kind: training, entrypoint: pkg.mod:main}",
    "data": None,
    "request": "request: {limit: 30m}",
    "output": "output: {kind: results, url: /out/job/, files: [metrics.json]}",
}
LITERAL = (
    "a credential written into the spec would be stored in Prefect parameters and shown in logs (got a literal value); "
    "use {secret: BLOCK_NAME} (a Prefect Secret block) or {env: VAR_NAME}, or leave it out and set the store's "
    "standard environment variables (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, "
    "AZURE_STORAGE_ACCOUNT_KEY)"
)
BLOCK = "must name a Prefect Secret block: lowercase letters, digits and dashes"
EMPTY = (
    "an empty credential is not a reference: it would be passed to the store as the credential (got {}); "
    "use {{secret: BLOCK_NAME}} (a Prefect Secret block) or {{env: VAR_NAME}}, or leave it out and set the store's "
    "standard environment variables (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, "
    "AZURE_STORAGE_ACCOUNT_KEY)"
)
GLOB = (
    "must name one folder, not a pattern: '*', '?' and '[' are glob characters (got {}); "
    "remove them; files are written into this folder by name, so it cannot hold a wildcard or a ?query"
)
OVERLAP = (
    "{0}: must not overlap an input: the job would write into its own inputs (got {1}); "
    "give {0} a folder of its own, outside every input"
)
TRIAL_INPUTS = "data:\n  - {name: a, url: /in/a.csv}\n  - {name: b, url: /in/b.csv}\n  - {name: c, url: /in/c.csv}\n"


def doc(**sections: str | None) -> str:
    """A valid spec with some top-level sections replaced (None drops one)."""
    merged = {**BASE, **sections}
    return "\n".join(text for text in merged.values() if text) + "\n"


def live(path: str, what: str, got: str) -> str:
    return f"{path}: live work is refused: {what} (got {got}); {LIVE}"


CASES = [
    # --- the four declarations and their rules ---
    ("no-output", doc(output=None), [NO_OUTPUT]),
    ("null-output", doc(output="output: null"), [NO_OUTPUT]),
    ("neither-duration-nor-limit", doc(request="request: {gpus: 1}"), [
        "request: at least one of 'duration' (expected run time) or 'limit' (hard stop) is required "
        "(got neither); add e.g. limit: 30m",
    ]),
    ("no-request", doc(request=None), [
        "request: required field is missing; add e.g. request: {cpus: 1, limit: 30m}",
    ]),
    ("duration-over-limit", doc(request="request: {duration: 1h, limit: 30m}"), [
        "request.duration: must be <= limit (got duration 1h > limit 30m); raise limit or lower duration",
    ]),
    ("naive-deadline", doc(request="request: {limit: 1h, deadline: 2099-11-30T06:00:00}"), [
        "request.deadline: must include a timezone; a deadline without one is not guessed "
        "(got '2099-11-30T06:00:00'); add an offset, e.g. 2099-11-30T06:00:00+00:00",
    ]),
    ("past-deadline", doc(request="request: {limit: 1h, deadline: 2020-01-01T00:00:00+00:00}"), [
        "request.deadline: must be in the future; this deadline has already passed "
        "(got '2020-01-01T00:00:00+00:00'); set a later finish-by time, or drop the deadline",
    ]),
    ("unparseable-deadline", doc(request="request: {limit: 1h, deadline: tomorrow}"), [
        "request.deadline: must be a date-time with a timezone, e.g. 2026-11-30T06:00:00+00:00 (got 'tomorrow')",
    ]),
    ("bad-memory", doc(request="request: {limit: 1h, memory: 4 gigs}"), [
        "request.memory: must be a memory size such as 512MB, 1.5GB, 4GiB or a number of bytes "
        "(got '4 gigs'); unknown memory unit 'gigs'; use B, kB, MB, GB, TB or KiB, MiB, GiB, TiB",
    ]),
    ("zero-memory", doc(request="request: {limit: 1h, memory: 0GB}"), [
        "request.memory: must be more than 0 bytes (got '0GB')",
    ]),
    ("bad-duration", doc(request="request: {duration: soon}"), [
        f"request.duration: {DURATION} (got 'soon')",
    ]),
    ("zero-limit", doc(request="request: {limit: 0s}"), [
        "request.limit: must be longer than 0 seconds (got '0s')",
    ]),
    ("months-limit", doc(request="request: {limit: P1M}"), [
        f"request.limit: {DURATION} (got 'P1M'); months have no fixed length; use days, e.g. P30D",
    ]),
    ("negative-gpus", doc(request="request: {gpus: -1, limit: 1h}"), [
        "request.gpus: must be >= 0 (got -1)",
    ]),
    ("zero-cpus-and-negative-retries", doc(request="request: {cpus: 0, retries: -1, limit: 1h}"), [
        "request.cpus: must be >= 1 (got 0)",
        "request.retries: must be >= 0 (got -1)",
    ]),
    ("fractional-gpus", doc(request="request: {gpus: 0.5, limit: 1h}"), [
        "request.gpus: must be a whole number (got 0.5)",
    ]),
    ("both-entrypoint-and-command", doc(work="work: {kind: training, entrypoint: m:f, command: [python, x.py]}"), [
        "work: exactly one of 'entrypoint' or 'command' is required (got both); "
        "keep entrypoint for a Python callable or command for a program, not both",
    ]),
    ("neither-entrypoint-nor-command", doc(work="work: {kind: training}"), [
        "work: exactly one of 'entrypoint' or 'command' is required (got neither); "
        "add entrypoint: module:function for a Python callable, or command: [program, arg, ...]",
    ]),
    ("entrypoint-without-function", doc(work="work: {kind: training, entrypoint: e31.examples.digits}"), [
        "work.entrypoint: must be 'module:function' with dotted Python names on both sides "
        "(got 'e31.examples.digits'); e.g. e31.examples.digits:train",
    ]),
    ("entrypoint-file-path", doc(work="work: {kind: training, entrypoint: 'examples/digits.py:train'}"), [
        "work.entrypoint: must be 'module:function' with dotted Python names on both sides "
        "(got 'examples/digits.py:train'); use the module's import name, not a file path, "
        "e.g. e31.examples.digits:train",
    ]),
    ("command-as-string", doc(work="work: {kind: processing, command: python run.py}"), [
        "work.command: must be a list of program and arguments (got 'python run.py'); "
        "write it as a list, e.g. [python, run.py]",
    ]),
    ("empty-command", doc(work="work: {kind: processing, command: []}"), [
        "work.command: must be a non-empty list of program and arguments (got []); e.g. [python, train.py]",
    ]),
    ("unknown-work-kind", doc(work="work: {kind: batch, entrypoint: m:f}"), [
        "work.kind: must be one of 'training', 'inference', 'processing' or 'simulation' (got 'batch')",
    ]),
    ("spec-version-2", "spec_version: 2\n" + doc(), [
        "spec_version: must be 1 (got 2)",
    ]),
    ("unsafe-job-name", doc(name="name: nightly retrain/v2"), [
        "name: must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(got 'nightly retrain/v2'); it names the run and its folder, e.g. digits-nightly-retrain",
    ]),
    ("long-job-name", doc(name="name: " + "a" * 64), [
        "name: must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit "
        f"(got '{'a' * 56}...); it names the run and its folder, e.g. digits-nightly-retrain",
    ]),
    ("duplicate-data-names", doc(data="data: [{name: digits, url: a.csv}, {name: digits, url: b.csv}]"), [
        "data[1].name: duplicate input name; data[0] already uses it (got 'digits'); give each input its own name",
    ]),
    ("unsafe-data-name", doc(data="data: [{name: ../up, url: a.csv}, {name: '..', url: b.csv}]"), [
        "data[0].name: must be letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(got '../up'); it names the input's folder, e.g. digits",
        "data[1].name: must be letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(got '..'); it names the input's folder, e.g. digits",
    ]),
    ("empty-data-url", doc(data="data: [{name: digits, url: ''}]"), [
        "data[0].url: must be a non-empty URL or path (got '')",
    ]),
    ("bad-sha256", doc(data="data: [{name: digits, url: a.csv, sha256: 9f2c}]"), [
        "data[0].sha256: must be 64 hexadecimal characters (got '9f2c'); compute it with: sha256sum FILE",
    ]),
    ("data-not-a-list", doc(data="data: {name: digits, url: a.csv}"), [
        "data: must be a list (got {'name': 'digits', 'url': 'a.csv'})",
    ]),
    ("absolute-output-files", doc(output="output: {kind: model, url: /o/, files: [/etc/x, 'C:\\x', '\\\\srv\\x']}"), [
        f"output.files[0]: must be a relative path inside the output, not absolute (got '/etc/x'); {FILES_FIX}",
        f"output.files[1]: must be a relative path inside the output, not absolute (got 'C:\\\\x'); {FILES_FIX}",
        f"output.files[2]: must be a relative path inside the output, not absolute (got '\\\\\\\\srv\\\\x'); {FILES_FIX}",
    ]),
    ("dotdot-output-files", doc(output="output: {kind: model, url: /o/, files: [../x, a/../../x, '..\\x', '']}"), [
        f"output.files[0]: must stay inside the output: '..' is not allowed (got '../x'); {FILES_FIX}",
        f"output.files[1]: must stay inside the output: '..' is not allowed (got 'a/../../x'); {FILES_FIX}",
        f"output.files[2]: must stay inside the output: '..' is not allowed (got '..\\\\x'); {FILES_FIX}",
        f"output.files[3]: must be a non-empty relative path (got ''); {FILES_FIX}",
    ]),
    ("empty-output-files", doc(output="output: {kind: model, url: /o/, files: []}"), [
        "output.files: must list at least one file (got []); list the files whose existence marks "
        "the job complete, e.g. [model.pt, metrics.json]",
    ]),
    ("duplicate-output-files", doc(output="output: {kind: model, url: /o/, files: [model.pt, ./model.pt]}"), [
        "output.files[1]: duplicate of files[0] (got './model.pt'); list each file once",
    ]),
    ("output-missing-fields", doc(output="output: {kind: dataset}"), [
        "output.kind: must be one of 'model', 'results', 'files' or 'report' (got 'dataset')",
        "output.url: required field is missing; add the destination, e.g. url: results/NAME/",
        "output.files: required field is missing; add the files that mark the job complete, "
        "e.g. files: [metrics.json]",
    ]),
    ("both-every-and-every-steps",
     doc(output="output: {kind: model, url: /o/, files: [m.pt], checkpoint: {every: 2m, every_steps: 100}}"), [
        "output.checkpoint: set 'every' (a duration) or 'every_steps' (a step count), not both (got both); keep one",
    ]),
    ("bad-checkpoint-counts",
     doc(output="output: {kind: model, url: /o/, files: [m.pt], checkpoint: {every_steps: 0, keep: 0}}"), [
        "output.checkpoint.every_steps: must be >= 1 (got 0)",
        "output.checkpoint.keep: must be >= 1 (got 0)",
    ]),
    # --- unknown fields, with and without a close match, at several depths ---
    ("misspelt-top-level", doc(name="nmae: job"), [
        "nmae: unknown field; did you mean 'name'?",
    ]),
    ("unknown-top-level", doc() + "owner: me\n", [
        "owner: unknown field; allowed fields: spec_version, name, work, data, request, output",
    ]),
    ("misspelt-request", doc(request="request: {limt: 1h}"), [
        "request: at least one of 'duration' (expected run time) or 'limit' (hard stop) is required "
        "(got neither); add e.g. limit: 30m",
        "request.limt: unknown field; did you mean 'limit'?",
    ]),
    ("unknown-request", doc(request="request: {limit: 1h, colour: blue}"), [
        "request.colour: unknown field; allowed fields: nodes, gpus, gpu_type, cpus, memory, duration, limit, deadline, deadline_within, deadline_at, grace, retries, preemptible",
    ]),
    ("misspelt-checkpoint",
     doc(output="output: {kind: model, url: /o/, files: [m.pt], checkpoint: {every_step: 10}}"), [
        "output.checkpoint.every_step: unknown field; did you mean 'every_steps'?",
    ]),
    ("unknown-data-field", doc(data="data: [{name: d, url: a.csv, mirror: b.csv}]"), [
        "data[0].mirror: unknown field; allowed fields: name, url, sha256, storage_options",
    ]),
    # --- live work ---
    *[
        (f"live-kind-{kind}", doc(work=f"work: {{kind: {kind}, entrypoint: m:f}}"),
         [live("work.kind", what, repr(kind))])
        for kind, what in [
            ("service", "a service"), ("server", "a server"), ("daemon", "a daemon"),
            ("interactive", "interactive work"), ("control-loop", "a control loop"),
            ("control_loop", "a control loop"), ("stream", "a stream"), ("streaming", "streaming"),
            ("realtime", "real-time work"), ("real-time", "real-time work"), ("live", "live work"),
            ("notebook", "a notebook"), ("Service", "a service"),
        ]
    ],
    ("live-port", doc(work="work: {kind: inference, entrypoint: m:f, port: 8080}"), [
        live("work.port", "a port to expose", "port: 8080"),
    ]),
    ("live-ports-in-request", doc(request="request: {limit: 1h, ports: [80, 443]}"), [
        live("request.ports", "ports to expose", "ports: [80, 443]"),
    ]),
    ("live-latency", doc(request="request: {limit: 1h, latency: 50ms}"), [
        live("request.latency", "a latency requirement", "latency: '50ms'"),
    ]),
    ("live-interactive-key", doc(work="work: {kind: processing, entrypoint: m:f, interactive: true}"), [
        live("work.interactive", "an interactive session", "interactive: True"),
    ]),
    ("live-expose", doc(work="work: {kind: inference, entrypoint: m:f, expose: /predict}"), [
        live("work.expose", "an endpoint to expose", "expose: '/predict'"),
    ]),
    ("live-port-in-params", doc(work="work: {kind: inference, entrypoint: m:f, params: {http: {port: 80}}}"), [
        live("work.params.http.port", "a port to expose", "port: 80"),
    ]),
    # --- documents ---
    ("yaml-syntax-error", "name: job\nwork: {kind: training\nrequest: {limit: 1h}\n", [
        "job.yaml:3:8: YAML syntax error: expected ',' or '}', but got ':'",
    ]),
    ("yaml-bad-indent", "name: job\n  work: x\n", [
        "job.yaml:2:7: YAML syntax error: mapping values are not allowed here",
    ]),
    ("two-documents", doc() + "---\nname: other\n", [
        "job.yaml:5:1: YAML syntax error: but found another document",
    ]),
    ("list-document", "- name: job\n", [
        "(spec): the document must be a mapping of spec_version, name, work, data, request, output "
        "(got [{'name': 'job'}])",
    ]),
    ("scalar-document", "just text\n", [
        "(spec): the document must be a mapping of spec_version, name, work, data, request, output "
        "(got 'just text')",
    ]),
    ("empty-document", "# nothing here\n", [
        "(spec): the document must be a mapping of spec_version, name, work, data, request, output "
        "(got an empty document)",
    ]),
    ("duplicate-key", doc(request="request:\n  limit: 1h\n  gpus: 1\n  limit: 2h"), [
        "request.limit: duplicate key (got it twice, at lines 4 and 6); keep one",
    ]),
    ("duplicate-key-in-flow", doc(name="name: a\nname: b", request="request: {limit: 1h, limit: 2h}"), [
        "name: duplicate key (got it twice, at lines 1 and 2); keep one",
        "request.limit: duplicate key (got it twice, at line 4, columns 11 and 22); keep one",
    ]),
    # --- many problems at once, in several models ---
    ("many-problems",
     "name: bad name\n"
     "work: {kind: service, command: [serve], port: 8080}\n"
     "data: [{name: d, urll: a.csv}]\n"
     "request: {gpus: -1, memory: lots, duration: 2h, limit: 1h}\n"
     "output: {kind: model, url: /o/, files: [/abs]}\n"
     "extra: 1\n", [
        "name: must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(got 'bad name'); it names the run and its folder, e.g. digits-nightly-retrain",
        live("work.kind", "a service", "'service'"),
        live("work.port", "a port to expose", "port: 8080"),
        "request.gpus: must be >= 0 (got -1)",
        "request.memory: must be a memory size such as 512MB, 1.5GB, 4GiB or a number of bytes (got 'lots')",
        "request.duration: must be <= limit (got duration 2h > limit 1h); raise limit or lower duration",
        f"output.files[0]: must be a relative path inside the output, not absolute (got '/abs'); {FILES_FIX}",
        "data[0].urll: unknown field; did you mean 'url'?",
        "extra: unknown field; allowed fields: spec_version, name, work, data, request, output",
    ]),
    # --- the CLI's refusals of common first mistakes ---
    ("grace-not-shorter-than-limit", doc(request="request: {limit: 10m, grace: 1h}"), [
        "request.grace: must be shorter than the time limit: the stop warning comes grace before the hard stop "
        "(got grace 1h >= limit 10m); lower grace or raise limit",
    ]),
    ("default-grace-vs-duration-only", doc(request="request: {duration: 10s}"), [
        "request.grace: must be shorter than the time limit: the stop warning comes grace before the hard stop "
        "(got grace 10s >= limit 10s); lower grace or raise limit",
    ]),
    ("password-in-url", doc(data="data: [{name: d, url: 's3://AKIA:s3cr3t@bucket/x.csv'}]"), [
        "data[0].url: must not carry a password: specs are stored and shown (Prefect parameters, logs) "
        "(got a URL with user:password@); put credentials in environment variables (e.g. AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY) or a Prefect Secret block, and give the URL without them",
    ]),
    ("input-names-clash-as-variables", doc(data="data: [{name: a-b, url: /x}, {name: a.B, url: /y}]"), [
        "data[1].name: clashes with data[0] 'a-b': a command sees both as E31_DATA_A_B (got 'a.B'); rename one of them",
    ]),
    ("manifest-is-reserved", doc(output="output: {kind: results, url: /o, files: [manifest.json]}"), [
        "output.files[0]: manifest.json is written by E31 itself (got 'manifest.json'); "
        "give the work's file another name, e.g. results.json",
    ]),
    ("folder-as-output-file", doc(output="output: {kind: results, url: /o, files: [plots/]}"), [
        "output.files[0]: must name a file, not a folder (got 'plots/'); "
        "list a file that the work writes inside it, e.g. plots/loss.png",
    ]),
    ("binary-param", doc(work="work: {kind: training, entrypoint: 'a:b', params: {x: !!binary aGVsbG8=}}"), [
        "work.params: must hold JSON values only (strings, numbers, booleans, null, lists, mappings) (got bytes); "
        "the work receives params as JSON; write other values out as strings",
    ]),
    ("nan-param", doc(work="work: {kind: training, entrypoint: 'a:b', params: {x: .nan}}"), [
        "work.params: must hold JSON values only (strings, numbers, booleans, null, lists, mappings) "
        "(got a NaN or infinite number); the work receives params as JSON; write other values out as strings",
    ]),
    # --- storage_options: credentials by reference only, never echoed ---
    ("literal-secret-option", doc(output="output: {kind: results, url: /o, files: [m.json], storage_options: {secret: abc}}"), [
        f"output.storage_options.secret: {LITERAL}",
    ]),
    ("literal-nested-aws-secret",
     doc(output="output: {kind: results, url: /o, files: [m.json], "
                "storage_options: {client_kwargs: {aws_secret_access_key: x}}}"), [
        f"output.storage_options.client_kwargs.aws_secret_access_key: {LITERAL}",
    ]),
    ("literal-credentials-on-data-and-checkpoint",
     doc(data="data: [{name: d, url: 'az://c/x', storage_options: {account_name: acct, Account_Key: k1, sas_token: k2}}]",
         output="output: {kind: results, url: /o, files: [m.json], "
                "checkpoint: {url: 'gs://b/ck', storage_options: {token: k3, key: 7, anon: false}}}"), [
        f"data[0].storage_options.Account_Key: {LITERAL}",
        f"data[0].storage_options.sas_token: {LITERAL}",
        f"output.checkpoint.storage_options.token: {LITERAL}",
        f"output.checkpoint.storage_options.key: {LITERAL}",
    ]),
    ("bad-references",
     doc(output="output: {kind: results, url: /o, files: [m.json], storage_options: "
                "{key: {secret: ''}, token: {secret: 5}, password: {secret: a, env: b}, x: {env: 1A}, y: {secret: S3}}}"), [
        f"output.storage_options.key.secret: {BLOCK} (got an empty name); e.g. {{secret: s3-credentials}}",
        f"output.storage_options.token.secret: {BLOCK} (got a number); e.g. {{secret: s3-credentials}}",
        "output.storage_options.password: a reference must have exactly one key, 'secret' or 'env' (got keys secret, env); "
        "write {secret: BLOCK_NAME} (a Prefect Secret block) or {env: VAR_NAME} on its own",
        "output.storage_options.x.env: must name an environment variable: letters, digits and '_', not starting with "
        "a digit (got a name with other characters); e.g. {env: AWS_SECRET_ACCESS_KEY}",
        f"output.storage_options.y.secret: {BLOCK} (got a name with other characters); e.g. {{secret: s3-credentials}}",
    ]),
    ("reference-with-other-keys",
     doc(output="output: {kind: results, url: /o, files: [m.json], storage_options: "
                "{client_kwargs: {env: REGION, endpoint_url: 'http://minio:9000'}}}"), [
        "output.storage_options.client_kwargs: a reference must have exactly one key, 'secret' or 'env' "
        "(got keys env, endpoint_url); write {secret: BLOCK_NAME} (a Prefect Secret block) or {env: VAR_NAME} on its own",
    ]),
    ("non-json-option", doc(output="output: {kind: results, url: /o, files: [m.json], storage_options: {x: !!binary aGVsbG8=}}"), [
        "output.storage_options: must hold JSON values only (strings, numbers, booleans, null, lists, mappings) "
        "(got bytes); storage options are passed to fsspec as JSON; write other values out as strings",
    ]),
    ("password-in-option-url",
     doc(output="output: {kind: results, url: /o, files: [m.json], storage_options: {endpoint_url: 'https://u:pw@minio/'}}"), [
        "output.storage_options.endpoint_url: must not carry a password: specs are stored and shown (Prefect parameters, "
        "logs) (got a URL with user:password@); put credentials in environment variables (e.g. AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY) or a Prefect Secret block, and give the URL without them",
    ]),
    ("options-not-a-mapping", doc(output="output: {kind: results, url: /o, files: [m.json], storage_options: [anon]}"), [
        "output.storage_options: must be a mapping (got ['anon'])",
    ]),
    # --- literal credentials under other names, in headers, or empty ---
    ("literal-authorization-header",
     doc(data=TRIAL_INPUTS + "  - {name: d, url: 'https://h/x.csv', storage_options: "
                             "{headers: {Authorization: 'Bearer TRIAL-secret-Zq9', Accept: text/csv}}}"), [
        f"data[3].storage_options.headers.Authorization: {LITERAL}",
    ]),
    ("literal-credentials-under-other-names",
     doc(output="output: {kind: results, url: /o, files: [m.json], storage_options: {api_key: k1, apiKey: k2, "
                "accessKey: k3, Access-Key-Id: k4, secret_key: k5, client-secret: k6, SESSION_TOKEN: k7, "
                "connectionString: k8, passwd: k9, private-key: k10, region_name: eu, key_prefix: p}}"), [
        f"output.storage_options.{key}: {LITERAL}"
        for key in ("api_key", "apiKey", "accessKey", "Access-Key-Id", "secret_key", "client-secret", "SESSION_TOKEN",
                    "connectionString", "passwd", "private-key")
    ]),
    ("empty-credentials",
     doc(output="output: {kind: results, url: /o, files: [m.json], storage_options: "
                "{secret: '', sas_token: '  ', credentials: {}, password: [], token: null, anon: true}}"), [
        "output.storage_options.secret: " + EMPTY.format("an empty string"),
        "output.storage_options.sas_token: " + EMPTY.format("an empty string"),
        "output.storage_options.credentials: " + EMPTY.format("an empty mapping"),
        "output.storage_options.password: " + EMPTY.format("an empty list"),
    ]),
    ("literal-credential-headers-in-client-kwargs",
     doc(data="data: [{name: d, url: 'https://h/x', storage_options: {client_kwargs: {headers: {"
              "X-Api-Key: k1, Cookie: 'session=k2', X-Amz-Security-Token: k3, Proxy-Authorization: 'Basic k4', "
              "X-Auth-Token: k5, Ocp-Apim-Subscription-Key: k6, Authorization: '', "
              "Accept: text/csv, User-Agent: e31, Range: 'bytes=0-9'}}}}]"), [
        f"data[0].storage_options.client_kwargs.headers.{name}: {LITERAL}"
        for name in ("X-Api-Key", "Cookie", "X-Amz-Security-Token", "Proxy-Authorization", "X-Auth-Token",
                     "Ocp-Apim-Subscription-Key")
    ] + ["data[0].storage_options.client_kwargs.headers.Authorization: " + EMPTY.format("an empty string")]),
    ("literal-header-pair",
     doc(data="data: [{name: d, url: 'https://h/x', storage_options: "
              "{headers: [[Authorization, 'Bearer k1'], [Accept, text/csv], [X-Api-Key, {env: API_KEY}]]}}]"), [
        f"data[0].storage_options.headers[0][1]: {LITERAL}",
    ]),
    # --- output URLs that cannot work ---
    ("output-url-without-bucket",
     doc(output="output: {kind: results, url: 's3://', files: [m.json], checkpoint: {url: 'gs:///ck/'}}"), [
        "output.url: must name a bucket or host after 's3://' (got 's3://'); e.g. s3://my-bucket/results/NAME/",
        "output.checkpoint.url: must name a bucket or host after 'gs://' (got 'gs:///ck/'); "
        "e.g. gs://my-bucket/results/NAME/",
    ]),
    ("output-url-file-protocol-only", doc(output="output: {kind: results, url: 'file://', files: [m.json]}"), [
        "output.url: must name a folder after 'file://' (got 'file://'); e.g. file:///srv/results/NAME/",
    ]),
    ("glob-output-urls",
     doc(output="output: {kind: results, url: 's3://b/out/*', files: [m.json], "
                "checkpoint: {url: 's3://b/ck/?token=t0k3n'}}"), [
        "output.url: " + GLOB.format("'s3://b/out/*'"),
        "output.checkpoint.url: " + GLOB.format("'s3://b/ck/?token=***'"),
    ]),
    ("output-files-dot-and-inside-checkpoints",  # such a job could never complete / its file would be replaced
     doc(output="output: {kind: results, url: /out/job/, files: ['.', checkpoints/x.pt, ./checkpoints/y.pt]}"), [
        f"output.files[0]: must name a file, not the output folder itself (got '.'); {FILES_FIX}",
        "output.files[1]: checkpoints/ in the output holds E31's durable checkpoints, which are replaced as a run goes "
        "on (got 'checkpoints/x.pt'); give the work's file a path outside it, e.g. final/model.pt, or set "
        "output.checkpoint.url to another folder",
        "output.files[2]: checkpoints/ in the output holds E31's durable checkpoints, which are replaced as a run goes "
        "on (got './checkpoints/y.pt'); give the work's file a path outside it, e.g. final/model.pt, or set "
        "output.checkpoint.url to another folder",
    ]),
    ("http-output-urls",  # fsspec's HTTP filesystem cannot write: the job would run, then fail to return
     doc(output="output: {kind: results, url: 'https://files.example.org/out/', files: [m.json], "
                "checkpoint: {url: 'http://files.example.org/ck/?sig=s3cr3t'}}"), [
        "output.url: cannot be written to: fsspec's https:// filesystem only reads (got "
        "'https://files.example.org/out/'); return to an object store (s3://, gs://, az://) or a folder, and serve "
        "the files over HTTP from there",
        "output.checkpoint.url: cannot be written to: fsspec's http:// filesystem only reads (got "
        "'http://files.example.org/ck/?sig=***'); return to an object store (s3://, gs://, az://) or a folder, "
        "and serve the files over HTTP from there",
    ]),
    ("bracket-in-output-url", doc(output="output: {kind: results, url: '/out/run[1]/', files: [m.json]}"), [
        "output.url: " + GLOB.format("'/out/run[1]/'"),
    ]),
    ("output-url-is-an-input",
     doc(data="data: [{name: a, url: /in/a.csv}, {name: frames, url: /in/frames/}]",
         output="output: {kind: results, url: 'file:///in/frames', files: [m.json]}"), [
        OVERLAP.format("output.url", "the same place as data[1].url"),
    ]),
    ("output-url-inside-and-checkpoint-holding-inputs",
     doc(data="data: [{name: frames, url: 'file:///in/frames'}, {name: shards, url: 's3://bkt/shards/*.parquet'}]",
         output="output: {kind: results, url: 's3a://bkt/shards/out/', files: [m.json], checkpoint: {url: /in/}}"), [
        OVERLAP.format("output.url", "a folder inside data[1].url"),
        OVERLAP.format("output.checkpoint.url", "a folder that holds data[0].url"),
    ]),
    ("checkpoint-url-inside-an-input",
     doc(data="data: [{name: frames, url: /in/frames}]",
         output="output: {kind: results, url: /out/, files: [m.json], checkpoint: {url: /in/frames/./ck/}}"), [
        OVERLAP.format("output.checkpoint.url", "a folder inside data[0].url"),
    ]),
]


@pytest.mark.parametrize(("text", "lines"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_spec_reports_exact_problems(text, lines):
    with pytest.raises(SpecError) as info:
        parse_spec(text, source="job.yaml")
    count = len(lines)
    expected = "\n".join([f"invalid job spec job.yaml ({count} problem{'s' if count != 1 else ''})"]
                         + [f"  {line}" for line in lines])
    assert str(info.value) == expected
    assert info.value.source == "job.yaml"
    assert [str(p) for p in info.value.problems] == lines


def test_refusals_never_echo_the_credential():
    text = dict((c[0], c[1]) for c in CASES)["literal-authorization-header"]
    with pytest.raises(SpecError) as info:
        parse_spec(text, source="job.yaml")
    assert "TRIAL" not in str(info.value) and "Zq9" not in str(info.value) and "Traceback" not in str(info.value)


def test_case_table_is_large_enough():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


def test_design_example_exactly():
    text = (
        "name: digits-nightly-retrain\n"
        "work: {kind: training, entrypoint: e31.examples.digits:train}\n"
        "data:\n  - name: digits\n    urll: data/digits.csv.gz\n"
        "request: {gpus: -1, limit: 10m}\n"
        "output: {kind: model, url: /o/, files: [model.pt]}\n"
    )
    with pytest.raises(SpecError) as info:
        parse_spec(text, source="specs/examples/retrain.yaml")
    assert str(info.value) == (
        "invalid job spec specs/examples/retrain.yaml (2 problems)\n"
        "  request.gpus: must be >= 0 (got -1)\n"
        "  data[0].urll: unknown field; did you mean 'url'?"
    )
    assert info.value.problems == [
        Problem("request.gpus", "must be >= 0 (got -1)"),
        Problem("data[0].urll", "unknown field; did you mean 'url'?"),
    ]


def test_spec_error_is_a_value_error_and_pickles():
    import pickle

    err = SpecError("a.yaml", [Problem("(spec)", "x")])
    assert isinstance(err, ValueError)
    assert str(err) == "invalid job spec a.yaml (1 problem)\n  (spec): x"
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.problems == err.problems


def test_long_values_are_cut_in_got():
    text = doc(data="data: [{name: d, url: a.csv, sha256: " + "z" * 100 + "}]")
    with pytest.raises(SpecError) as info:
        parse_spec(text, source="job.yaml")
    assert info.value.problems == [Problem(
        "data[0].sha256",
        f"must be 64 hexadecimal characters (got '{'z' * 56}...); compute it with: sha256sum FILE",
    )]
