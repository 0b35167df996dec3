"""The database: SQLAlchemy models, the engine factory, schema checks and typed queries.

ORM rows stay inside this package's query functions; callers get frozen records.
"""
