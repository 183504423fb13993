"""Failures for tests and benchmarks: injected kills and losses (`injection`), a failure process
(`process`) and the emulator that draws failures from it inside a running job (`emulator`)."""
