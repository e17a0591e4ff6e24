"""ZeRO stages 0-3 as composable pieces: layouts, flat groups, reducers, stage-3 units."""
