"""Operations: logs, metrics, the fleet view, status, step traces, the progress line and the helpers every role process uses."""
