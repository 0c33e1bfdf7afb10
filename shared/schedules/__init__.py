"""Scheduled work (SPEC §9, seed 002): fixed-time, cron and interval schedules that start flows or v1 tasks."""
