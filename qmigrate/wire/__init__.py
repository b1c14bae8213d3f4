"""Everything that crosses a socket: the messages, their codec, packed arrays, the ZeroMQ transport and CurveZMQ security."""
