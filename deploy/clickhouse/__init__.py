"""ClickHouse migrations: ``NNN_name.sql`` files applied in order by ``Store.migrate()``."""
